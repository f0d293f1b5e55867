"""`specdec serve` on the embedded default model (SmolLM2-135M-Instruct), end to end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_answers_like_offline_chat_and_stops_cleanly_on_ctrl_c():
    expected = LLM(num_kv_blocks=64).chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "specdec.serving.cli",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # loading and the start-up timing, on a busy machine too
        while True:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        args = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=16)
        full = client.chat.completions.create(**args)
        chunks = client.chat.completions.create(stream=True, **args)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert full.choices[0].message.content == streamed == expected[0].text
        assert full.usage.completion_tokens == len(expected[0].token_ids)
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
