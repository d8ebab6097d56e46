"""The receiver examples of docs/http-targets.md, run against headers herdwick signs.

A reader copies these into their service, so each must accept what the http worker
sends (one v1, or two during an overlap) and refuse a tampered body, a stale t and a
header it cannot read. The Python handler runs in aiohttp on a real socket; the Node.js
and Go functions run where node and go are installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from herdwick.signing import signature_header
from tests.docs.test_commands import ROOT, blocks

DOC = ROOT / "docs" / "http-targets.md"
NEW, OLD = "whsec_new", "whsec_old"
BODY = b'{"order":42,"note":"caf\xc3\xa9"}'


def _block(fence: str, containing: str) -> str:
    [found] = [b.text for b in blocks(DOC) if b.fence == fence and containing in b.text]
    return found


def _cases() -> list[tuple[str, list[str], str, bytes, bool]]:
    """(what, the receiver's secrets, header, body, accepted?), signed now. The times off
    by a minute past the tolerance: a harness may start a second or two after `now`."""
    now = int(time.time())
    both = signature_header([NEW, OLD], BODY, now)
    return [
        ("one secret", [NEW], signature_header([NEW], BODY, now), BODY, True),
        ("overlap, receiver knows the old", [OLD], both, BODY, True),
        ("overlap, receiver knows the new", [NEW], both, BODY, True),
        ("receiver lists both", [NEW, OLD], signature_header([OLD], BODY, now), BODY, True),
        ("another scheme beside", [NEW], "v0=abc," + signature_header([NEW], BODY, now),
         BODY, True),
        ("wrong secret", [OLD], signature_header([NEW], BODY, now), BODY, False),
        ("tampered body", [NEW], signature_header([NEW], BODY, now), BODY + b" ", False),
        ("stale", [NEW], signature_header([NEW], BODY, now - 360), BODY, False),
        ("from the future", [NEW], signature_header([NEW], BODY, now + 360), BODY, False),
        ("no t", [NEW], signature_header([NEW], BODY, now).split(",", 1)[1], BODY, False),
        ("no v1", [NEW], f"t={now}", BODY, False),
        ("garbage", [NEW], "garbage", BODY, False),
        ("empty", [NEW], "", BODY, False),
    ]


def test_the_example_header_is_what_herdwick_signs() -> None:
    section = DOC.read_text().split("\n## Verifying a delivery\n")[1].split("\n## ")[0]
    header = re.search(r"Herdwick-Signature: (t=\d+,v1=[0-9a-f]{64})\n", section).group(1)
    assert header == signature_header(["whsec_example"], b'{"order":42}', 1796212800)


async def test_the_python_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    source = _block("python", "verify_signature")
    for what, secrets, header, body, accepted in _cases():
        monkeypatch.setenv("HERDWICK_SIGNING_SECRETS", ",".join(secrets))
        namespace: dict = {}
        exec(compile(source, str(DOC), "exec"), namespace)
        client = TestClient(TestServer(namespace["app"]))
        await client.start_server()
        try:
            headers = {"Content-Type": "application/json", "Idempotency-Key": "j:1"}
            if header:
                headers["Herdwick-Signature"] = header
            resp = await client.post("/hooks/herdwick", data=body, headers=headers)
            assert resp.status == (204 if accepted else 400), (what, await resp.text())
        finally:
            await client.close()


def _accepted(command: list[str], cwd: Path, cases: list,
              env: dict[str, str] | None = None) -> list[bool]:
    """Runs a harness that reads the cases as JSON on stdin (the body as latin-1 text, one
    character a byte) and prints whether each was accepted, as a JSON array."""
    feed = json.dumps([{"secrets": s, "header": h, "body": b.decode("latin-1")}
                       for _, s, h, b, _ in cases])
    done = subprocess.run(command, cwd=cwd, input=feed, capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_nodejs_function(tmp_path: Path) -> None:
    harness = """
const cases = JSON.parse(require("node:fs").readFileSync(0, "utf8"));
console.log(JSON.stringify(cases.map(({secrets, header, body}) => {
  try { verifySignature(secrets, header, Buffer.from(body, "latin1")); return true; }
  catch (e) { return false; }
})));
"""
    (tmp_path / "verify.js").write_text(_block("js", "verifySignature") + harness)
    cases = _cases()
    got = _accepted(["node", "verify.js"], tmp_path, cases)
    assert got == [accepted for *_, accepted in cases], [c[0] for c in cases]


@pytest.mark.skipif(shutil.which("go") is None, reason="go is not installed")
def test_the_go_function(tmp_path: Path) -> None:
    source = _block("go", "VerifySignature").replace("package hooks", "package main", 1)
    harness = """
func main() {
	var cases []struct{ Secrets []string; Header, Body string }
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		panic(err)
	}
	got := []bool{}
	for _, c := range cases {
		body := make([]byte, 0, len(c.Body))
		for _, r := range c.Body {
			body = append(body, byte(r))
		}
		got = append(got, VerifySignature(c.Secrets, c.Header, body, 5*time.Minute) == nil)
	}
	json.NewEncoder(os.Stdout).Encode(got)
}
"""
    source = source.replace("import (", 'import (\n\t"encoding/json"\n\t"os"', 1)
    (tmp_path / "main.go").write_text(source + harness)
    # One file, standard library only: no module, nothing to download.
    env = {**os.environ, "GO111MODULE": "off", "GOCACHE": str(tmp_path / "cache")}
    cases = _cases()
    got = _accepted(["go", "run", "main.go"], tmp_path, cases, env)
    assert got == [accepted for *_, accepted in cases], [c[0] for c in cases]
