"""A real indexed dataset for the Megatron-LM tests, made the way a Megatron-LM user makes one:
a small text corpus (the snapshot's own README, licence and docs, one JSON document per
paragraph) turned into Megatron's `.bin`/`.idx` format by the snapshot's own
`tools/preprocess_data.py`, so nothing is downloaded.

The text is tokenized byte by byte: each UTF-8 byte of a paragraph is one token, its value
(what GPT-2's byte-level BPE with an empty merge list gives, without its files). The corpus
holds those ids as Megatron-LM's `NullTokenizer` reads text (ids separated by spaces), and
the tool and the training run both use `--tokenizer-type NullTokenizer --vocab-size 256`:
a tokenizer every supported release has offline (0.19 dropped `--legacy-tokenizer`, and its
GPT-2 BPE needs `transformers`). The end-of-document id the tool appends is the tokenizer's
own: 256 in core_v0.16.1 (whose NullTokenizer adds one id), 255 from 0.17 on (its last id);
255 is never a byte of UTF-8 text, so it is distinct from every text token either way.
"""
import json
import subprocess
import sys
from pathlib import Path

from megatron_lm_runs import job_env

CORPUS_FILES = ("README.md", "LICENSE", "megatron/training/datasets/README.md",
                "megatron/rl/README.md")
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def write_corpus(snapshot: Path, out: Path) -> Path:
    """One JSON line {"text": "<byte ids>"} per non-empty paragraph of the snapshot's docs."""
    path = out / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for name in CORPUS_FILES:
            for para in (snapshot / name).read_text(encoding="utf-8").split("\n\n"):
                if para.strip():
                    ids = " ".join(str(b) for b in para.strip().encode("utf-8"))
                    f.write(json.dumps({"text": ids}) + "\n")
    return path


def build_indexed_dataset(snapshot: Path, out: Path) -> list[str]:
    """Run the snapshot's `tools/preprocess_data.py` on the corpus; returns the Megatron-LM
    flags that train on the result (`--data-path` and the tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
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
    cmd = [sys.executable, "-c", run_tool, str(tool), "--input", str(corpus),
           "--output-prefix", str(prefix), "--append-eod", "--workers", "1", *TOKENIZER]
    env = job_env(snapshot)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    data = Path(f"{prefix}_text_document")
    if proc.returncode != 0 or not data.with_suffix(".bin").is_file():
        raise AssertionError(f"preprocess_data.py failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ["--data-path", str(data), *TOKENIZER, "--data-cache-path", str(out / "cache")]
