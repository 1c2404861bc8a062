"""The benchmarks' pytest set-up: the repository root off sys.path (``python3 -m pytest`` puts it
first, where kernels/, data/, models/ ... would shadow installed distributions of those names,
e.g. the ``kernels`` that transformers imports; tpfuse itself is reached as ``tpfuse.*``)."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
