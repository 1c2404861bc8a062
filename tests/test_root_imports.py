"""Python started in the repository root: the root's folders do not shadow installed libraries.

The root is first on ``sys.path`` there (``python -c``, ``python -m``, Jupyter); its ``kernels/``
folder hands the bare name ``kernels`` over to the installed ``kernels`` distribution that
transformers imports (``tpfuse._shadow``), and without one fails naming ``tpfuse.kernels``.
"""
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WHERE_IS_KERNELS = "import kernels, os; print(os.path.realpath(kernels.__file__))"


def _python(code: str, cwd: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_transformers_imports_from_the_root(tmp_path):
    outside = _python(WHERE_IS_KERNELS, str(tmp_path))
    assert outside.returncode == 0, outside.stderr
    inside = _python("from transformers import GPT2LMHeadModel\n" + WHERE_IS_KERNELS, ROOT)
    assert inside.returncode == 0, inside.stderr
    # the same distribution as a Python started elsewhere, not the root's folder
    assert inside.stdout.splitlines()[-1] == outside.stdout.strip()
    assert not inside.stdout.strip().startswith(os.path.join(ROOT, "kernels"))


def test_tpfuse_kernels_is_still_tpfuses_own_from_the_root():
    code = "import tpfuse.kernels as k, os; print(os.path.realpath(k.__file__), k.matmul.__name__)"
    result = _python(code, ROOT)
    assert result.returncode == 0, result.stderr
    path, name = result.stdout.split()
    assert path == os.path.realpath(os.path.join(ROOT, "kernels", "__init__.py"))
    assert name == "matmul"


def test_without_a_kernels_distribution_the_error_names_tpfuse_kernels():
    # -S: no site-packages, so no installed `kernels`; the root (the working directory) stays
    result = _python("import kernels", ROOT, "-S")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "tpfuse.kernels" in last, result.stderr
