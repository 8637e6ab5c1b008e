"""The job's secret: what a process must prove it knows before the job lets it join.

A secret is generated once, at launch (`secrets.token_hex(32)`: 256 bits), and handed to
the job's ranks and to legitimate joiners through the environment (`DYNATRAIN_JOB_SECRET`)
or a file only its owner can read (mode 0600). It is never written to the rendezvous store,
never logged, and never printed: `JobSecret` hides its value from `repr`/`str`, and only
uses it to compute and check HMAC-SHA256 tags (`elastic/join.py`).

A secret file that others can read (any group/other permission bit), that is not a regular
file (a link, a FIFO: never waited on), that belongs to another user or that is bigger
than a secret is refused with a clear error: a secret others can read proves nothing, and
a file someone else owns could have been planted (`safe_files.read_bytes`). A generated
secret is written in a checked directory, whole or not at all.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, MutableMapping, Optional

from ..vps.errors import DynatrainError
from ..safe_files import ReadRules, UnsafeFileError, create_new, read_bytes

log = logging.getLogger("dynatrain")

ENV_VAR = "DYNATRAIN_JOB_SECRET"
DEFAULT_FILE_NAME = "job_secret"  # inside --dynatrain-rendezvous-dir when no file is named
MIN_LENGTH = 32  # characters; a generated secret has 64 (hex of 32 random bytes)
MAX_FILE_BYTES = 4096
_RULES = ReadRules("secret file", MAX_FILE_BYTES, private=True)


class SecretError(DynatrainError):
    """A job secret that cannot be used (unsafe file, too short, ...). Its message never
    contains the secret."""


@dataclass(frozen=True, slots=True)
class JobSecret:
    """The secret, kept out of logs: `repr` and `str` never show it."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or len(self.value) < MIN_LENGTH:
            raise SecretError(f"a job secret needs at least {MIN_LENGTH} characters "
                              f"(got {len(self.value) if isinstance(self.value, bytes) else '?'});"
                              f" generate one with `python -c 'import secrets; "
                              f"print(secrets.token_hex(32))'`")
        if any(c <= 0x20 or c == 0x7F for c in self.value):
            raise SecretError("a job secret must not contain whitespace or control characters")

    @classmethod
    def generate(cls) -> "JobSecret":
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str) -> "JobSecret":
        return cls(text.strip().encode())

    def tag(self, message: bytes) -> str:
        """HMAC-SHA256 of `message` keyed by the secret (hex)."""
        return hmac.new(self.value, message, hashlib.sha256).hexdigest()

    def verify(self, message: bytes, tag: str) -> bool:
        """Whether `tag` is this secret's tag of `message`, in constant time (a comparison
        that stops at the first differing byte would leak how much of a forged tag is right)."""
        return hmac.compare_digest(self.tag(message).encode(), tag.encode("utf-8", "replace"))

    def export(self, env: MutableMapping[str, str]) -> None:
        """Put the secret in `env` (a rank's or a child process's environment)."""
        env[ENV_VAR] = self.value.decode()

    def __str__(self) -> str:
        return "JobSecret(<hidden>)"


def read_secret_file(path: str | Path) -> JobSecret:
    """The secret in `path`; SecretError when the file is unsafe or unusable.

    The checks run on the opened file (fstat), so the file cannot be swapped between the
    check and the read; a symbolic link is refused (O_NOFOLLOW), a FIFO is never waited
    on (O_NONBLOCK), and at most `MAX_FILE_BYTES` are read."""
    path = Path(path)
    try:
        data = read_bytes(path, _RULES)
    except FileNotFoundError:
        raise SecretError(f"secret file {path} does not exist") from None
    except UnsafeFileError as e:
        hint = f" (run `chmod 600 {path}`)" if "group or others" in str(e) else ""
        raise SecretError(f"{e}{hint}") from None
    try:
        return JobSecret.from_text(data.decode("ascii"))
    except UnicodeDecodeError:
        raise SecretError(f"secret file {path} does not hold ASCII text") from None
    except SecretError as e:
        raise SecretError(f"secret file {path}: {e}") from None


def write_secret_file(path: str | Path, secret: JobSecret) -> Path:
    """Write `secret` to a new file `path` with mode 0600, whole, in a checked directory
    (a reader never sees a partial secret, nor a moment where the file is readable by
    others); SecretError when the directory is unsafe or `path` exists already."""
    path = Path(path)
    try:
        placed = create_new(path.parent, path.name, secret.value + b"\n", 0o600)
    except (UnsafeFileError, OSError) as e:
        raise SecretError(f"secret file {path} not written: {e}") from None
    if not placed:
        raise SecretError(f"secret file {path} not written: something is there already")
    return path


def load_secret(secret_file: Optional[str | Path] = None,
                env: Optional[Mapping[str, str]] = None,
                rendezvous_dir: Optional[str] = None) -> Optional[JobSecret]:
    """The secret this process was given, in order: `secret_file` when named (it must
    exist), the environment variable, the default file in `rendezvous_dir` when it exists.
    None when there is none."""
    env = os.environ if env is None else env
    if secret_file:
        return read_secret_file(secret_file)
    text = env.get(ENV_VAR)
    if text:
        try:
            return JobSecret.from_text(text)
        except SecretError as e:
            raise SecretError(f"${ENV_VAR}: {e}") from None
    default = default_secret_file(rendezvous_dir)
    if default is not None and (default.exists() or default.is_symlink()):
        return read_secret_file(default)
    return None


def default_secret_file(rendezvous_dir: Optional[str]) -> Optional[Path]:
    """Where a generated secret is written when no file is named: next to the rendezvous
    store, where a joiner looks for it by default."""
    return Path(rendezvous_dir) / DEFAULT_FILE_NAME if rendezvous_dir else None


def establish(secret_file: Optional[str | Path], rendezvous_dir: Optional[str],
              env: Optional[Mapping[str, str]] = None) -> tuple[Optional[JobSecret], str]:
    """The job's secret at launch (on one process). In order: the file named by
    `secret_file` (created with a new secret when it does not exist yet), the environment
    variable, the default file in the rendezvous directory (created likewise). Returns
    (secret, where it came from, for the log: never the secret itself); None when there is
    nowhere to hand a new secret to joiners."""
    env = os.environ if env is None else env
    if not secret_file and env.get(ENV_VAR):
        return load_secret(None, env), f"${ENV_VAR}"
    path = Path(secret_file) if secret_file else default_secret_file(rendezvous_dir)
    if path is None:
        return None, "none (no --dynatrain-secret-file, no rendezvous directory)"
    if path.exists() or path.is_symlink():
        return read_secret_file(path), f"file {path}"
    secret = JobSecret.generate()
    write_secret_file(path, secret)
    return secret, f"generated at launch, written to {path} (mode 0600)"


def share_with_ranks(secret_file: Optional[str | Path], rendezvous_dir: Optional[str]
                     ) -> Optional[JobSecret]:
    """Collective at launch: rank 0 establishes the secret (`establish`), every rank gets it
    and puts it in its environment (so that processes it starts inherit it). It travels on
    the job's own communicator, like the training state. An unusable secret file fails on
    every rank with the same error (not only on rank 0, which would leave the others hung)."""
    import torch.distributed as dist

    box: list = [None, "", None]
    if dist.get_rank() == 0:
        try:
            secret, where = establish(secret_file, rendezvous_dir)
            box = [None if secret is None else secret.value, where, None]
        except SecretError as e:
            box = [None, "", str(e)]
    dist.broadcast_object_list(box, src=0)
    value, where, error = box
    if error is not None:
        raise SecretError(error)
    if value is None:
        log.info("job secret: %s; join requests are not reviewed", where)
        return None
    secret = JobSecret(value)
    secret.export(os.environ)
    log.info("job secret: %s", where)
    return secret
