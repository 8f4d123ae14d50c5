"""Open WebUI in front of `sluice serve` (tests/openwebui.py): its chat with a tool on, the tool-call round trip,
the title task and a follow-up over that history. Slow: installs Open WebUI once (several minutes), then ~2-5
minutes on a CPU. SLUICE_OPENWEBUI_VENV names a venv to use or make (default ~/.cache/sluice/openwebui-VERSION)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import openwebui


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_openwebui_chat_with_a_tool(tmp_path):
    venv = Path(os.environ.get("SLUICE_OPENWEBUI_VENV") or Path.home() / ".cache" / "sluice" / f"openwebui-{openwebui.VERSION}")
    r = openwebui.run(venv, tmp_path)
    assert openwebui.MODEL in r["models"]
    out = r["first"]["output"]
    calls = [o for o in out if o["type"] == "function_call"]
    results = [o for o in out if o["type"] == "function_call_output"]
    # the call Sluice parsed, run by Open WebUI; its result went back to Sluice, whose answer (under tool_choice
    # required, another call) Open WebUI parsed too
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"] in ("Oslo", "Paris")
    assert results[0]["output"][0]["text"] == f"sunny in {json.loads(calls[0]['arguments'])['city']}"
    assert len(calls) == 2 and calls[1]["name"] == "get_weather"
    assert r["title"] and r["title"] != "New Chat"
    second = r["second"]
    assert second["done"] and not second.get("error") and second["content"].strip()  # the history with the call renders
    assert r["requests"].get('status="ok"', 0) >= 4 and not r["requests"].get('status="rejected"')
