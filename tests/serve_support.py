"""Helpers of the server tests and the server benchmark: a tiny local model directory
(random Llama weights saved with ``save_pretrained``, a byte-level BPE tokenizer trained with
the ``tokenizers`` package, a chat template), a free loopback port, and a ``kvcanary serve``
subprocess that is waited for and stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "a canary in the cache",
          "key value blocks are paged and shared", "hello world, hello server",
          "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"] * 20


def build_tiny_model(path, *, layers=2, hidden=64, heads=4, kv_heads=2, vocab=384,
                     seed=0) -> str:
    """Write a random Llama (tiny by default) with its tokenizer into ``path``; returns the
    path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    special = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, do_sample=False)
    model.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """``kvcanary serve MODEL *options -- --host 127.0.0.1 --port P *serve_options`` in a
    subprocess (``unguarded``: ``transformers serve`` itself), started and waited for
    (``/health``)."""

    def __init__(self, model_dir, *options, serve_options=(), log_path=None, timeout=180,
                 unguarded=False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                  "--cb-block-size", "16", "--cb-num-blocks", "64", *serve_options]
        if unguarded:       # transformers' own server, for comparison
            cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve",
                   str(model_dir), "--continuous-batching", *common]
        else:
            cmd = [sys.executable, "-m", "kvcanary", "serve", str(model_dir), *options, "--",
                   *common]
        self.stderr = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.stderr, stderr=self.stderr,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcanary serve exited {self.proc.returncode}: "
                                   f"{self.output()[-3000:]}")
            try:
                if get_json(self.url + "/health", timeout=2).get("status") == "ok":
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvcanary serve did not come up: {self.output()[-3000:]}")

    def output(self) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def signal(self, sig=signal.SIGTERM, timeout=60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.log_path and not self.stderr.closed:
            self.stderr.close()
