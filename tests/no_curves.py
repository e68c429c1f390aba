"""Runs a command of the project (`python tests/no_curves.py SCRIPT ARGS...` is `python SCRIPT ARGS...`) without the
trainer's curves.png: matplotlib's plot at the end of every run took 3-6 s of a CLI test's 15-30 (about a fifth of
the suite), and only the tests marked @pytest.mark.curves look at the picture (in-process; conftest.no_curves
does the same for a test's in-process runs).
conftest.run_cli starts every command this way; VAE_TEST_CURVES=1 draws the curves as a run does.

Nothing of the project is imported before the script runs (a torchvision built for another torch must still give
the script's own one line): run_log.Reporter.plot_curves is replaced when run_log is first imported."""
import importlib.abc
import importlib.util
import os
import runpy
import sys


class WithoutCurves(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "run_log":
            return None
        sys.meta_path.remove(self)  # once, and the real finders find the module
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_without_curves(module):
            exec_module(module)
            module.Reporter.plot_curves = lambda self, final=False: None
        spec.loader.exec_module = exec_without_curves
        return spec


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # what `python SCRIPT` puts first
    if not os.environ.get("VAE_TEST_CURVES"):
        sys.meta_path.insert(0, WithoutCurves())
    runpy.run_path(script, run_name="__main__")
