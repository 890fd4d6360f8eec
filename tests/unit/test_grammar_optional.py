"""llguidance is needed only where a grammar is used: a stage, the draft or the router
without it start and serve requests without response_format, and a request with one
gets a clear error (common/spec/grammar.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from specpipe.common.spec import grammar
from specpipe.common.spec.grammar import GrammarError, ResponseFormat


def test_every_service_module_imports_without_llguidance() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["llguidance"] = None  # not installed
        import specpipe.services.stage_service, specpipe.services.draft_service
        import specpipe.services.router.service, specpipe.common.runtime.verifier
        import specpipe.common.spec.verify
        print("imported")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]


def test_a_grammar_without_llguidance_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    assert not ResponseFormat().constrains  # text needs no grammar library
    with pytest.raises(GrammarError, match="needs the llguidance package"):
        ResponseFormat("json_object").grammar_text()
    with pytest.raises(GrammarError, match="needs the llguidance package"):
        grammar.load_grammar_tokenizer(str(tmp_path), 16, (1,))
