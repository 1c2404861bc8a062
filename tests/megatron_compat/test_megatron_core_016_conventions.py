"""megatron-core 0.16.1 conventions the compat layer keeps, each checked against values worked
out by hand from megatron-core's source: ``utils.is_torch_min_version``."""
import pytest
import torch

from tpfuse.megatron_compat.utils import is_torch_min_version


@pytest.mark.parametrize("installed, asked, at_least, strictly_above", [
    ("2.4.0", "2.4.0", True, False),                 # equality: >= holds, > does not
    ("2.4.1", "2.4.0", True, True),
    ("2.3.9", "2.4.0", False, False),
    ("2.4.0+cu121", "2.4.0", True, True),            # a local version sorts above its public one
    ("2.4.0a0+git1234", "2.4.0", False, False),      # a pre-release sorts below the release
    ("2.4.0rc1", "2.4.0a0", True, True),
    ("2.4.0rc1", "2.4.0rc1", True, False),
    ("2.10.0", "2.9.0", True, True),                 # numeric, not string, comparison
    ("2.13.0+cpu", "2.13", True, True),
])
def test_is_torch_min_version_compares_as_packaging_orders(monkeypatch, installed, asked,
                                                           at_least, strictly_above):
    monkeypatch.setattr(torch, "__version__", installed)
    assert is_torch_min_version(asked) is at_least
    assert is_torch_min_version(asked, check_equality=True) is at_least
    assert is_torch_min_version(asked, check_equality=False) is strictly_above
