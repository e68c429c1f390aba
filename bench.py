"""Speed and memory benchmarks of the VAE trainer and its input pipeline: `python bench.py --help` says what it
measures. The launcher of the package bench/ (one module per section; bench/cli.py holds the flags and the run)."""
import sys

from common import exit_if_torch_pair_broken
if __name__ == "__main__":  # first: a torch/torchvision mismatch is one line, not an import's traceback
    exit_if_torch_pair_broken()
from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
