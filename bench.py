"""Speed and memory benchmarks of the VAE trainer and its input pipeline: `python bench.py --help` says what it
measures. The launcher of the package bench/ (one module per section; bench/cli.py holds the flags and the run)."""
import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
