"""The `dynatrain` command on bad input: one line on stderr and a non-zero status, never a
traceback; and its help: every flag explained, an example per subcommand that parses.

In-process calls of `cli.main` (a subprocess costs ~2 s of imports each); the few actions
that would start processes or wait on a network peer are replaced by recorders."""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain_megatron import __version__, cli

HOSTILE = ["", "0", "-1", "nan", "inf", "x", "99999999999999999999", "tp0", "\u00e9\u00e9",
           "host:abc", "host:99999"]


class Hung(Exception):
    """A command that did not end within `CALL_LIMIT_S` (it waits on something)."""


CALL_LIMIT_S = 120
# flags that make a command wait for a running job: not fuzzed (no job runs here)
WAITING_FLAGS = {"--wait"}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """`dynatrain ARGV` in this process: (status, stdout, stderr); any exception other
    than argparse's exit propagates, which is the failure this file looks for. A call
    that runs past `CALL_LIMIT_S` fails with its arguments instead of hanging the suite."""
    def hung(signum, frame):
        raise Hung(f"dynatrain {' '.join(map(str, argv))} ran past {CALL_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(CALL_LIMIT_S)
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line_error(rc: int, err: str, argv) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0, f"{argv}: status 0 on bad input"
    assert len(lines) == 1, f"{argv}: {len(lines)} lines on stderr:\n{err}"
    assert "Traceback" not in err and "error" in lines[0], (argv, err)


@pytest.fixture
def files(tmp_path):
    """Hostile files: a directory, non-UTF-8 bytes, bad YAML, YAML of wrong types."""
    d = tmp_path / "a_dir"
    d.mkdir()
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00name: \x80\x81\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n  from: {\n")
    wrong_types = tmp_path / "types.yaml"
    wrong_types.write_text("name: t\nnum_layers: four\nhidden_size: 64\nnum_attention_heads: 4\n"
                           "ffn_hidden_size: 256\nvocab_size: 1000\nseq_length: yes\n")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    return {"dir": d, "binary": binary, "bad_yaml": bad_yaml, "wrong_types": wrong_types,
            "list": listing}


@pytest.fixture
def no_spawn(monkeypatch):
    """`launch` and `bench-switch` record that they would start processes, and do not."""
    calls = []
    from dynatrain_megatron.bench import report as bench_report
    from dynatrain_megatron.bench import run as bench_run
    from dynatrain_megatron.loop import launch as loop_launch

    monkeypatch.setattr(loop_launch, "launch",
                        lambda n, cmd: calls.append(("launch", n, cmd)) or (0, []))
    monkeypatch.setattr(bench_run, "run_bench",
                        lambda cfg, timeout: calls.append(("bench", cfg)) or {})
    monkeypatch.setattr(bench_report, "format_summary", lambda s: "summary")
    return calls


# ------------------------------------------------------------------ the reported cases
def test_each_reported_bad_input_is_one_line(tmp_path, files, no_spawn, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    sig = tmp_path / "switch.json"
    patch_dir = tmp_path / "mlm"
    patch_dir.mkdir()
    (patch_dir / "pretrain_gpt.py").write_bytes(b"# \xff\xfe not UTF-8\n")
    (patch_dir / "megatron" / "training").mkdir(parents=True)
    (patch_dir / "megatron" / "training" / "training.py").write_text("# a changed file\n")
    cases = [
        (["request", "--signal-file", files["dir"], "--layout", "tp1"], "is a directory"),
        (["request", "--signal-file", "", "--layout", "tp1"], "empty path"),
        (["request", "--signal-file", tmp_path / "nodir" / "s.json", "--layout", "tp1"],
         "does not exist"),
        (["request", "--signal-file", sig, "--layout", "tp1", "--model", files["bad_yaml"]],
         "not readable YAML"),
        (["request", "--signal-file", sig, "--layout", "tp1", "--model", files["binary"]],
         "not readable YAML"),
        (["request", "--signal-file", sig, "--layout", "tp1", "--model",
          files["wrong_types"]], "'num_layers' must be a int"),
        (["request", "--signal-file", sig, "--layout", "tp1", "--model", files["list"]],
         "not a mapping"),
        (["plan", "--scenario", files["bad_yaml"]], "not readable YAML"),
        (["plan", "--scenario", files["binary"]], "not readable YAML"),
        (["plan", "--scenario", files["list"]], "not a mapping"),
        (["plan", "--scenario", _scenario(tmp_path, "ranks_per_node: eight")],
         "ranks_per_node must be int"),
        (["plan", "--scenario", _scenario(tmp_path, "world: true")], "world must be int"),
        (["plan", "--scenario", _scenario(tmp_path, "world: 0")], "world must be >= 1"),
        (["plan", "--model", "tiny-gpt", "--from", "tp1", "--to", "tp2", "--world", "4",
          "--ranks-per-node", "0"], "must be >= 1"),
        (["plan", "--model", "tiny-gpt", "--from", "tp1", "--to", "tp2", "--world", "4",
          "--round-latency-us", "nan"], "finite"),
        (["plan", "--model", "tiny-gpt", "--from", "tp1", "--to", "tp2", "--world", "4",
          "--inter-node-gbps", "50"], "renamed --inter-node-gbytes-per-s"),
        (["suggest", "--model", "tiny-gpt", "--world", "4", "--bucket-size", "0"],
         "must be >= 1"),
        (["suggest", "--model", "tiny-gpt", "--world", "4", "--intra-node-gbps", "450"],
         "renamed --intra-node-gbytes-per-s"),
        (["suggest", "--model", "tiny-gpt", "--world", "4", "--dp-overlap", "2"], "<= 1"),
        (["lost", "--model", "tiny-gpt", "--layout", "tp1pp2dp2", "--world", "4", "--dead",
          "x"], "not a rank number"),
        (["lost", "--model", "tiny-gpt", "--layout", "tp1pp2dp2", "--world", "4", "--dead",
          "1,1"], "given twice"),
        (["join", "--store", "nonsense"], "expected HOST:PORT"),
        (["join", "--store", "host:abc"], "is not a number"),
        (["join", "--store", "host:99999"], "outside 1..65535"),
        (["launch", "--nproc", "0", script], "must be >= 1"),
        (["launch", "--nproc-per-node", "0", script], "must be >= 1"),
        (["launch", "--nproc-per-node", "2", tmp_path / "missing.py"], "not found"),
        # a non-UTF-8 file: refused as text we cannot read, or by its fingerprint
        (["megatron-lm", "patch", patch_dir], ("not UTF-8", "is not supported")),
        (["megatron-lm", "patch", script], "not a directory"),
        (["layout", "--model", "tiny-gpt", "--layout", "tp2xx", "--world", "4"],
         "ppf,ppl,doi,dp"),
    ]
    for argv, expected in cases:
        rc, _, err = run_cli(argv, capsys)
        assert_one_line_error(rc, err, argv)
        assert any(e in err for e in ((expected,) if isinstance(expected, str) else expected)), \
            (argv, err)
    assert not no_spawn, no_spawn  # nothing was started


def _scenario(tmp_path: Path, line: str) -> Path:
    p = tmp_path / f"scenario{abs(hash(line))}.yaml"
    p.write_text(f"model: tiny-gpt\nfrom: tp1pp2\nto: tp2pp2\nworld: 4\n{line}\n")
    return p


def test_the_old_launcher_flag_still_works_and_torchruns_spelling_too(tmp_path, no_spawn,
                                                                      capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    for flag in ("--nproc-per-node", "--nproc_per_node", "--nproc"):
        assert run_cli(["launch", flag, "3", script, "--lr", "1"], capsys)[0] == 0
    assert [c[1] for c in no_spawn] == [3, 3, 3]
    assert no_spawn[0][2][1:] == [str(script), "--lr", "1"]


def test_version_names_the_package_and_its_pins(capsys):
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.startswith(f"dynatrain {__version__} (torch ")
    assert "megatron-core" in out


# ------------------------------------------------------------------ the help
def _subparsers(parser: argparse.ArgumentParser, prefix=("dynatrain",)):
    """(command words, parser) of every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subparsers(sub, prefix + (name,))


def test_every_flag_has_help_with_its_unit_and_every_command_an_example():
    parser = cli.build_parser()
    seen = 0
    for words, sub in _subparsers(parser):
        seen += 1
        assert sub.epilog and sub.epilog.startswith("examples:"), words
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.help == argparse.SUPPRESS:  # a renamed flag, refused
                continue
            assert action.help, f"{' '.join(words)} {action.option_strings}: no help"
            takes_value = action.nargs != 0 and action.option_strings
            if takes_value and not action.choices:
                # the metavar says what the value is: DEVICES, SECONDS, BYTES, GB/S, ...
                assert action.metavar, f"{' '.join(words)} {action.option_strings}: no metavar"
    assert seen >= len(cli.SUBCOMMANDS) + 1  # + megatron-lm patch


def test_every_example_in_the_help_parses():
    parser = cli.build_parser()
    for words, sub in _subparsers(parser):
        for line in sub.epilog.splitlines()[1:]:
            example = line.split("#")[0].strip()
            argv = shlex.split(example)
            assert argv[0] == "dynatrain", line
            parsed = parser.parse_args(argv[1:])  # exits (fails the test) on a bad example
            assert callable(parsed.func), line


# ------------------------------------------------------------------ the fuzz
def _base_commands(tmp_path: Path) -> dict[str, list[str]]:
    """A valid, fast invocation of every subcommand (no process is started for real)."""
    script = tmp_path / "train.py"
    script.write_text("")
    rdv = tmp_path / "rdv-missing"
    return {
        "layout": ["layout", "--model", "tiny-gpt", "--layout", "tp2pp2", "--world", "4"],
        "lost": ["lost", "--model", "tiny-gpt", "--layout", "tp1pp2doi2dp2", "--world", "4",
                 "--dead", "3"],
        "plan": ["plan", "--model", "tiny-gpt", "--from", "tp2pp2", "--to", "tp1pp2",
                 "--world", "4"],
        "request": ["request", "--signal-file", str(tmp_path / "switch.json"), "--layout",
                    "tp1pp2"],
        "join": ["join", "--rendezvous-dir", str(rdv), "--timeout", "1"],
        "launch": ["launch", "--nproc-per-node", "2", str(script)],
        "bench-switch": ["bench-switch", "--model", "tiny-gpt", "--nproc", "4", "--from",
                         "tp2pp2", "--to", "tp1pp4"],
        "megatron-lm": ["megatron-lm", "patch", str(tmp_path)],
        "suggest": ["suggest", "--model", "tiny-gpt", "--world", "4", "--top", "2",
                    "--global-batch-size", "8", "--no-transformer-engine"],
    }


def _options(parser: argparse.ArgumentParser, words: tuple[str, ...]):
    """(flag, takes a value) of every option of the subcommand `words`."""
    for w, sub in _subparsers(parser):
        if w[1:] == words:
            for a in sub._actions:
                if a.option_strings and not isinstance(a, argparse._HelpAction):
                    yield a.option_strings[0], a.nargs != 0
                if not a.option_strings and a.dest not in ("megatron_lm_command",):
                    yield None, True  # a positional


def test_fuzz_every_subcommands_arguments(tmp_path, files, no_spawn, capsys, monkeypatch):
    """Each option of each subcommand given each hostile value (and each hostile file), the
    rest of the command valid: exit 0, or non-zero with one line on stderr. Any traceback
    fails. (Tens of milliseconds a call: most values stop at parsing.) Run in a scratch
    directory: a value taken as a relative path (a request's signal file) is written there."""
    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser()
    values = HOSTILE + [str(p) for p in files.values()]
    calls = 0
    for name, base in _base_commands(tmp_path).items():
        words = (name, "patch") if name == "megatron-lm" else (name,)
        for flag, takes_value in _options(parser, words):
            if flag in WAITING_FLAGS:
                continue
            tried = values if takes_value else [None]
            for v in tried:
                argv = list(base)
                if flag is None:  # the positional (a path or the script): replace the last
                    argv[-1] = v
                elif flag in argv:
                    i = argv.index(flag)
                    if v is None:
                        continue
                    argv[i + 1] = v
                else:
                    argv += [flag] if v is None else [flag, v]
                rc, _, err = run_cli(argv, capsys)
                calls += 1
                if rc != 0:
                    assert_one_line_error(rc, err, argv)
    assert calls > 1000


def test_the_installed_command_runs_and_reports_one_line(tmp_path):
    """The console script itself (one subprocess): status and stderr as in-process."""
    exe = Path(sys.executable).with_name("dynatrain")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "dynatrain_megatron.cli"]
    p = subprocess.run(cmd + ["lost", "--model", "tiny-gpt", "--layout", "tp1pp2dp2",
                              "--world", "4", "--dead", "x"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "not a rank number" in p.stderr


def test_a_rendezvous_dir_that_is_a_file_is_refused_when_parsing(tmp_path, capsys):
    """The training script's flag (Megatron-LM's parser or ours): refused by argparse before
    any rank starts, naming the path."""
    from dynatrain_megatron.loop.arguments import add_dynatrain_args

    f = tmp_path / "rdv"
    f.write_text("")
    parser = add_dynatrain_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--dynatrain-rendezvous-dir", str(f)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --dynatrain-rendezvous-dir: {f} exists and is not a directory" in err
    assert "Traceback" not in err
    ok = parser.parse_args(["--dynatrain-rendezvous-dir", str(tmp_path / "new")])
    assert ok.dynatrain_rendezvous_dir == str(tmp_path / "new")  # created by the job later
