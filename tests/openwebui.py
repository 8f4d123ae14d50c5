"""Open WebUI against `sluice serve`, offline, as a user's chat would run: `python tests/openwebui.py [--venv DIR]`.

Installs Open WebUI (pinned) in a venv of its own outside the repo (default ~/.cache/sluice/openwebui-VERSION; a
torch wheel named by $SLUICE_TORCH_WHEEL goes in first, else pip fetches torch itself), starts `sluice serve` on the
bundled model and Open WebUI against it (no Ollama, no embedding model, no update check), signs in through
/api/v1/auths/signin and chats through Open WebUI's own API with a tool on: the model's call is run by Open WebUI
and its result sent back, the chat gets a title, and a follow-up over that history is answered. Prints the
results as JSON; tests/test_openwebui.py asserts them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

VERSION = "0.12.4"
EMAIL, PASSWORD = "admin@example.com", "sluice-test"
MODEL = "sluice-default"
# An Open WebUI tool: the choice of city is closed, so that even the bundled model (which writes no city names)
# gives a valid call when told to call
TOOL = '''
from typing import Literal


class Tools:
    def get_weather(self, city: Literal["Oslo", "Paris"]) -> str:
        """
        The weather in a city.
        :param city: the city
        """
        return f"sunny in {city}"
'''


def ensure_venv(venv: Path) -> Path:
    """Open WebUI's executable in `venv`, installed there first when missing."""
    exe = venv / "bin" / "open-webui"
    if exe.is_file():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if os.environ.get("SLUICE_TORCH_WHEEL"):  # a local CPU build: pip would otherwise fetch CUDA's, several GB
        subprocess.run([*pip, os.environ["SLUICE_TORCH_WHEEL"]], check=True)
    subprocess.run([*pip, f"open-webui=={VERSION}"], check=True)
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(cmd: list[str], env: dict, log: Path, url: str, timeout: float):
    """Run cmd until the block ends (terminated by its pid, killed if it lingers); wait until `url` answers 200."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}); its log: {log}\n{log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout:.0f} s; log: {log}")
            time.sleep(1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def openwebui_env(data: Path, sluice_url: str) -> dict:
    """The settings that make Open WebUI clean against Sluice offline (README, Open WebUI)."""
    return {**os.environ, "DATA_DIR": str(data), "OPENAI_API_BASE_URL": sluice_url + "/v1", "OPENAI_API_KEY": "none",
            "ENABLE_OLLAMA_API": "false", "RAG_EMBEDDING_MODEL": "", "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1",
            "ENABLE_VERSION_UPDATE_CHECK": "false", "WEBUI_ADMIN_EMAIL": EMAIL, "WEBUI_ADMIN_PASSWORD": PASSWORD,
            "WEBUI_SECRET_KEY": "sluice-test",
            # the tool is called under tool_choice required, which Open WebUI repeats on the result's request: one round
            "CHAT_RESPONSE_MAX_TOOL_CALL_ITERATIONS": "1"}


class Chat:
    """One Open WebUI chat driven through its API as its page drives it (a saved chat, a task per reply)."""

    def __init__(self, base: str, token: str):
        self.base, self.h = base, {"Authorization": f"Bearer {token}"}
        self.history: dict = {}
        self.last: str | None = None
        self.id = self.post("/api/v1/chats/new", {"chat": {"title": "New Chat", "models": [MODEL], "messages": [],
                                                           "history": {"messages": {}, "currentId": None}}})["id"]

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.base + path, headers=self.h, json=body, timeout=120)
        r.raise_for_status()
        return r.json()

    def get(self) -> dict:
        return httpx.get(f"{self.base}/api/v1/chats/{self.id}", headers=self.h, timeout=60).json()

    def say(self, text: str, timeout: float, **extra) -> dict:
        """Send a user turn (with the history so far) and wait for the reply to be done; the reply's message."""
        now = int(time.time())
        uid, aid = str(uuid.uuid4()), str(uuid.uuid4())
        user = {"id": uid, "parentId": self.last, "childrenIds": [aid], "role": "user", "content": text, "timestamp": now,
                "models": [MODEL]}
        if self.last:
            self.history[self.last]["childrenIds"].append(uid)
        self.history[uid] = user
        self.history[aid] = {"id": aid, "parentId": uid, "childrenIds": [], "role": "assistant", "content": "", "model": MODEL,
                             "timestamp": now, "done": False}
        chain = [m for m in self.history.values() if m["role"] in ("user", "assistant")]
        self.post(f"/api/v1/chats/{self.id}", {"chat": {"models": [MODEL], "messages": chain,
                                                          "history": {"messages": self.history, "currentId": aid}}})
        messages = [{"role": m["role"], "content": m["content"]} for m in chain if m["id"] != aid]
        self.post("/api/chat/completions", {"model": MODEL, "stream": True, "messages": messages, "chat_id": self.id, "id": aid,
                                            "session_id": "sluice-test", "user_message": user, "params": {}, **extra})
        deadline = time.time() + timeout
        while time.time() < deadline:
            chat = self.get()
            reply = chat["chat"]["history"]["messages"].get(aid, {})
            if reply.get("done"):
                self.history = chat["chat"]["history"]["messages"]
                self.last = aid
                return reply
            time.sleep(1)
        raise TimeoutError(f"no reply within {timeout:.0f} s")


def run(venv: Path, work: Path, timeout: float = 600) -> dict:
    """Install (once), start both servers, chat; what happened, as a dict."""
    exe = ensure_venv(venv)
    sp, wp = free_port(), free_port()
    sluice_url, base = f"http://127.0.0.1:{sp}", f"http://127.0.0.1:{wp}"
    sluice_cmd = [sys.executable, "-m", "sluice.cli", "serve", "--port", str(sp), "--truncate", "left"]
    with serving(sluice_cmd, dict(os.environ), work / "sluice.log", sluice_url + "/health", timeout), \
         serving([str(exe), "serve", "--host", "127.0.0.1", "--port", str(wp)], openwebui_env(work / "data", sluice_url),
                 work / "openwebui.log", base + "/health", timeout):
        token = httpx.post(base + "/api/v1/auths/signin", json={"email": EMAIL, "password": PASSWORD}, timeout=60).json()["token"]
        h = {"Authorization": f"Bearer {token}"}
        models = [m["id"] for m in httpx.get(base + "/api/models", headers=h, timeout=60).json()["data"]]
        # Open WebUI's ~36 built-in tools take ~8,600 prompt tokens: more than the bundled model's context; a reply
        # long enough for a whole call in the bundled model's tokens
        chat = Chat(base, token)
        chat.post("/api/v1/models/create", {"id": MODEL, "name": MODEL, "meta": {"capabilities": {"builtin_tools": False}},
                                            "params": {"max_tokens": 100}})
        httpx.get(base + "/api/models", headers=h, timeout=60).raise_for_status()  # reloads the models with their settings
        chat.post("/api/v1/tools/create", {"id": "weather", "name": "weather", "content": TOOL,
                                           "meta": {"description": "The weather", "manifest": {}}})
        first = chat.say("What is the weather in Oslo?", timeout, tool_ids=["weather"], tool_choice="required",
                         parallel_tool_calls=False, background_tasks={"title_generation": True})
        deadline = time.time() + timeout
        while chat.get()["title"] == "New Chat" and time.time() < deadline:  # the title task runs after the reply
            time.sleep(1)
        title = chat.get()["title"]
        second = chat.say("Thanks. Anything else?", timeout)
        metrics = httpx.get(sluice_url + "/metrics", timeout=30).text
    counts = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("sluice_requests_total{", "sluice_request_errors_total{"))}
    return {"models": models, "first": first, "title": title, "second": second, "requests": counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "sluice" / f"openwebui-{VERSION}")
    p.add_argument("--work", type=Path, help="logs and Open WebUI's data (default: a new temporary folder)")
    args = p.parse_args(argv)
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-openwebui-"))
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args.venv, work), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
