"""``tpfuse._optional.import_optional``: the module when it imports, else one ImportError naming
the feature, the package, its pip extra and the import's own reason."""
import pytest

from tpfuse._optional import import_optional


def test_an_installed_module_is_returned():
    import json.decoder

    assert import_optional("json.decoder", extra="unused", feature="unused") is json.decoder


def test_a_missing_package_is_named_with_its_extra():
    with pytest.raises(ImportError) as caught:
        import_optional("tpfuse_no_such_package.sub", extra="hf", feature="--some-flag")
    assert str(caught.value) == (
        "--some-flag needs the optional package 'tpfuse_no_such_package' "
        "(pip install 'tpfuse[hf]'): No module named 'tpfuse_no_such_package'")
    assert isinstance(caught.value.__cause__, ImportError)


def test_a_way_to_run_without_it_is_offered():
    with pytest.raises(ImportError, match=r"\(pip install 'tpfuse\[hf\]'\), or use --tokenizer "
                                          r"byte: No module named"):
        import_optional("tpfuse_no_such_package", extra="hf", feature="tokenizer 'x.json'",
                        instead="use --tokenizer byte")
