"""A real indexed dataset for the Megatron-LM tests, made the way a Megatron-LM user makes one:
a small text corpus (the snapshot's own README, licence and docs, one JSON document per
paragraph) turned into Megatron's `.bin`/`.idx` format by the snapshot's own
`tools/preprocess_data.py`, with a GPT-2 BPE tokenizer whose files are written here, so
nothing is downloaded.

The tokenizer is GPT-2's byte-level BPE with an empty merge list: its vocabulary is the 256
byte symbols of GPT-2's byte-to-unicode table plus `<|endoftext|>`, so every byte of the
text is one token. It goes through Megatron-LM's legacy `GPT2BPETokenizer` unchanged
(`--legacy-tokenizer`: the new tokenizer system needs `transformers`).
"""
import json
import subprocess
import sys
from pathlib import Path

from megatron_lm_runs import job_env

CORPUS_FILES = ("README.md", "LICENSE", "megatron/training/datasets/README.md",
                "megatron/rl/README.md")
EOD = "<|endoftext|>"


def _byte_symbols() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol table (its published rule:
    printable latin-1 bytes map to themselves, the others to 256 + n in byte order)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def write_tokenizer(out: Path) -> tuple[Path, Path]:
    """vocab.json (byte symbol -> its byte value, `<|endoftext|>` -> 256) and merges.txt
    (a header, no merges) under `out`."""
    vocab = {sym: b for b, sym in _byte_symbols().items()}
    vocab[EOD] = 256
    vocab_file, merge_file = out / "vocab.json", out / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n", encoding="utf-8")
    return vocab_file, merge_file


def write_corpus(snapshot: Path, out: Path) -> Path:
    """One JSON line {"text": paragraph} per non-empty paragraph of the snapshot's docs."""
    path = out / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for name in CORPUS_FILES:
            for para in (snapshot / name).read_text(encoding="utf-8").split("\n\n"):
                if para.strip():
                    f.write(json.dumps({"text": para.strip()}) + "\n")
    return path


def build_indexed_dataset(snapshot: Path, out: Path) -> list[str]:
    """Run the snapshot's `tools/preprocess_data.py` on the corpus; returns the Megatron-LM
    flags that train on the result (`--data-path` and the tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = write_tokenizer(out)
    corpus = write_corpus(snapshot, out)
    prefix = out / "corpus"
    tool = snapshot / "tools" / "preprocess_data.py"
    # on the CPU, Megatron-LM's imports need the runtime the patched pretrain_gpt.py applies
    # (triton is imported at module level); the tool's worker pool forks from this process
    run_tool = ("import runpy, sys\n"
                "from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm\n"
                "prepare_megatron_lm()\n"
                "sys.argv = sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab_file),
                 "--merge-file", str(merge_file), "--legacy-tokenizer"]
    cmd = [sys.executable, "-c", run_tool, str(tool), "--input", str(corpus),
           "--output-prefix", str(prefix), "--append-eod", "--workers", "1", *tokenizer]
    env = job_env(snapshot)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    data = Path(f"{prefix}_text_document")
    if proc.returncode != 0 or not data.with_suffix(".bin").is_file():
        raise AssertionError(f"preprocess_data.py failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ["--data-path", str(data), *tokenizer, "--data-cache-path", str(out / "cache")]
