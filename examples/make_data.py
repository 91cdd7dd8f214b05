"""Regenerate examples/data.json: 240 varied conversations, deterministic.

    python examples/make_data.py > examples/data.json

The turns below were written for this project. Samples combine them into single- and
multi-turn conversations, with and without system prompts, short and long, in several
languages and with code; a tenth use ShareGPT's ``from``/``value`` keys.
"""

from __future__ import annotations

import json
import random

SYSTEMS = [
    "You are a concise assistant.",
    "You are a senior engineer who explains trade-offs.",
    "Tu es un assistant qui répond en français.",
    "You answer with working code and a one-line explanation.",
]

PAIRS = [
    ("What is speculative decoding?",
     "A small draft model proposes several tokens; the large model checks them in one pass "
     "and keeps the longest prefix it agrees with, so output quality is unchanged."),
    ("Why write to a temp file and rename it?",
     "Rename is atomic on POSIX file systems: readers see the old file or the new one, never "
     "a half-written file. Fsync the file before and the directory after."),
    ("Explain tensor parallelism in two sentences.",
     "Each weight matrix is split across GPUs and every GPU computes its slice. An all-reduce "
     "after each block puts the partial results back together."),
    ("Write a Python function that checks if a number is prime.",
     "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n"
     "    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n"
     "        i += 1\n    return True"),
    ("How do I reverse a list in Rust?",
     "Call `v.reverse()` to reverse in place, or `v.iter().rev().collect::<Vec<_>>()` for a "
     "reversed copy."),
    ("Quelle est la capitale de l'Australie ?",
     "La capitale de l'Australie est Canberra, et non Sydney comme on le croit souvent."),
    ("¿Cómo se dice 'hidden state' en español?",
     "Se suele decir «estado oculto»: la activación interna de una capa del modelo."),
    ("Was ist ein Tokenizer?",
     "Ein Tokenizer zerlegt Text in Einheiten (Tokens), die das Modell als Zahlen verarbeitet."),
    ("用一句话解释什么是注意力机制。",
     "注意力机制让模型在处理每个词时，根据相关程度给其他词分配不同的权重。"),
    ("日本語で「こんにちは」はどういう意味ですか？",
     "「こんにちは」は昼間に使う一般的な挨拶で、英語の \"hello\" に近い意味です。"),
    ("Что такое контрольная сумма?",
     "Это короткое число, вычисленное по данным; если данные изменились, сумма почти "
     "наверняка изменится тоже."),
    ("Give me a SQL query for the ten newest orders.",
     "SELECT id, customer_id, created_at FROM orders ORDER BY created_at DESC LIMIT 10;"),
    ("What does fsync guarantee?",
     "That the file's data and metadata have reached stable storage before the call returns, "
     "as far as the drive honours flush commands."),
    ("Is Redis durable?",
     "Only if you ask: with AOF and appendfsync always every write is on disk before the reply; "
     "with no persistence a restart loses everything."),
    ("Write a bash loop that retries a command five times.",
     "for i in 1 2 3 4 5; do\n  cmd && break\n  echo \"attempt $i failed\" >&2\n"
     "  sleep $((i * 2))\ndone"),
    ("What is bf16?",
     "bfloat16 keeps float32's 8-bit exponent with a 7-bit mantissa: the same range, less "
     "precision, half the bytes."),
    ("Summarise the plot of Hamlet in one line.",
     "A Danish prince feigns madness to avenge his father's murder, and nearly everyone dies."),
    ("How many bytes is one token's hidden state for H=7168 in bf16, four layers?",
     "7168 × 4 × 2 = 57,344 bytes per token."),
    ("Translate 'the queue is empty' into Italian.", "La coda è vuota."),
    ("What's a good name for a cat?", "Miso, Pixel or Turing, depending on the cat's temper."),
    ("Can you write a haiku about GPUs?",
     "Silicon rivers\nthousands of small hands at once\nsummer in the rack"),
    ("Write a JavaScript debounce function.",
     "function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n    clearTimeout(t);\n"
     "    t = setTimeout(() => fn(...args), ms);\n  };\n}"),
    ("Why is my Celery task running twice?",
     "With acks_late, a task that runs longer than the broker's visibility timeout is "
     "delivered again. Keep the time limit below the timeout and make the task idempotent."),
    ("한국어로 '감사합니다'는 무슨 뜻인가요?",
     "'감사합니다'는 'thank you'라는 뜻의 정중한 표현입니다."),
    ("Explain the difference between a process and a thread.",
     "Processes have separate address spaces; threads share one. Threads are cheaper to start "
     "and switch, processes isolate failures."),
    ("What is 17 * 23?", "17 × 23 = 391."),
    ("Name three uses of tmpfs.",
     "Fast scratch space for build artefacts, inter-process hand-off files, and caches that may "
     "vanish on reboot."),
    ("Write a C function that returns the length of a string.",
     "#include <stddef.h>\nsize_t my_strlen(const char *s) {\n    const char *p = s;\n"
     "    while (*p) p++;\n    return (size_t)(p - s);\n}"),
    ("How do I pin memory in PyTorch?",
     "Allocate with `torch.empty(..., pin_memory=True)` or call `.pin_memory()`; copies from "
     "the GPU into it can then run asynchronously with `non_blocking=True`."),
    ("Qu'est-ce qu'un disque NVMe ?",
     "Un SSD relié directement au bus PCIe, avec des files de commandes profondes et une "
     "latence bien plus faible qu'un disque SATA."),
]

FOLLOW_UPS = [
    ("Can you say that more briefly?", "In short: yes, as above, in fewer words."),
    ("Give an example.", "Say the farm has 100 samples and one worker dies: its task returns "
                         "to the queue and another worker finishes it."),
    ("Why does that matter?", "Because a multi-day run must survive crashes without losing or "
                              "corrupting a single finished file."),
    ("Merci !", "Avec plaisir."),
    ("And in Python?", "import os\nos.replace('out.tmp', 'out.bin')"),
]

LONG_PARAGRAPH = (
    "A crash-safe pipeline treats the disk as the source of truth. Each unit of work is small "
    "and idempotent; it is acknowledged only after its output has been written to a temporary "
    "file, flushed, renamed into place and read back. If a process dies at any point, the "
    "message returns to the queue and the next attempt either finds a verified output and "
    "stops, or redoes the work from the start. "
)


def conversation(rng: random.Random, i: int) -> dict[str, object]:
    kind = i % 6
    msgs: list[dict[str, str]] = []
    if kind in (1, 4):
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    turns = 1 if kind in (0, 1) else rng.randint(2, 4)
    for t in range(turns):
        q, a = rng.choice(PAIRS) if t == 0 else rng.choice(PAIRS + FOLLOW_UPS)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if kind == 5:  # long: a document to summarise
        doc = LONG_PARAGRAPH * rng.randint(6, 20)
        msgs = [{"role": "user", "content": "Summarise this design note:\n\n" + doc},
                {"role": "assistant", "content": "Work is acknowledged only after its output "
                 "is verified on disk, so crashes cost time, never data. " * 3}]
    return {"id": f"ex-{i:04d}", "messages": msgs}


def sharegpt(sample: dict[str, object]) -> dict[str, object]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    msgs = sample["messages"]
    assert isinstance(msgs, list)
    return {"id": sample["id"],
            "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


def main() -> None:
    rng = random.Random(20261130)
    samples = [conversation(rng, i) for i in range(240)]
    samples = [sharegpt(s) if i % 10 == 7 else s for i, s in enumerate(samples)]
    print(json.dumps(samples, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
