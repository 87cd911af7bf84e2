"""The files of ``h2o-compress batch``: the prompts it reads (JSONL or plain text) and the answers it appends.

- `read_requests`: INPUT as request dicts, a malformed line as an error result naming its line, before
  anything runs; a file that is not text at all (binary, not UTF-8, a directory) is refused as a whole.
- `AnswerFile`: OUTPUT, opened for appending only (never replaced, never truncated beyond a half-written last
  line), locked against a second run, each answer written as one line and flushed: a killed run loses nothing it
  answered, and a rerun skips the ids already there (resume).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from h2o_compress.runtime.batch_requests import REQUEST_KEYS, BatchResult
from h2o_compress.utils.errors import InputError, short
from h2o_compress.utils.files import MAX_TEXT_BYTES, read_text

#: The keys every answer line has (and ``error`` where ``finish_reason`` is ``error``).
ANSWER_KEYS = ("id", "text", "prompt_tokens", "new_tokens", "finish_reason")


def read_requests(path) -> list[dict | BatchResult]:
    """The requests of INPUT ``path``, one per line: JSONL (a ``.jsonl`` file, or one whose first line opens with
    ``{``) gives each line's object (keys `REQUEST_KEYS`; ``id``
    defaults to the line number); plain text gives each line as a prompt, its id the line number. A line that is
    empty, not a JSON object or repeats an earlier id becomes an error result naming its line.

    Raises:
        InputError: the file is missing, not a regular file, larger than 256 MiB, not UTF-8 text (binary), or holds
            no line at all.
    """
    text = read_text(path, "input file", InputError, limit=MAX_TEXT_BYTES)
    if "\x00" in text:
        raise InputError(f"input file {short(str(path))} holds NUL bytes: it is binary, not JSONL or text; allowed: "
                         "a JSONL file (one JSON object per line) or a text file (one prompt per line)")
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise InputError(f"input file {short(str(path))} holds no prompt; allowed: one prompt per line")
    first = next(line for line in lines if line.strip())
    as_json = str(path).endswith(".jsonl") or first.lstrip().startswith("{")
    requests: list[dict | BatchResult] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        request = _parse_line(line, number, as_json)
        if isinstance(request, dict):
            ident = str(request.get("id", number))
            if ident in seen:
                request = _error(number, f"line {number}: id {ident!r} repeats line {seen[ident]}; allowed: one line "
                                         "per id (answers are matched to prompts by id; this one is answered as id "
                                         f"{str(number)!r}, its line number)")
            else:
                seen[ident] = number
                request.setdefault("id", ident)
        requests.append(request)
    return requests


def _parse_line(line: str, number: int, as_json: bool) -> dict | BatchResult:
    if not line.strip():
        return _error(number, f"line {number} is empty; allowed: a prompt on every line")
    if not as_json:
        return {"id": str(number), "prompt": line}
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        return _error(number, f"line {number} is not JSON ({getattr(exc, 'msg', 'nested too deeply')}); allowed: one "
                              "JSON object per line")
    if not isinstance(value, dict):
        return _error(number, f"line {number} is a JSON {type(value).__name__}, not an object; allowed: "
                              f"{{\"id\": ..., \"prompt\": \"...\"}}")
    unknown = sorted(set(value) - set(REQUEST_KEYS))
    if unknown:
        return _error(number, f"line {number}: unknown key {', '.join(map(repr, unknown))}; allowed: "
                              f"{', '.join(REQUEST_KEYS)}", value.get("id"))
    ident = value.get("id", number)
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        return _error(number, f"line {number}: id {short(ident)} is invalid; allowed: a text or an integer")
    value["id"] = str(ident)
    return value


def _error(number: int, message: str, ident=None) -> BatchResult:
    ident = str(number) if isinstance(ident, bool) or not isinstance(ident, (str, int)) else str(ident)
    return BatchResult(id=ident, index=number - 1, finish_reason="error", error=message)


def answered_ids(data: bytes, path) -> set[str]:
    """The ids of the complete answer lines of ``data`` (an OUTPUT file's bytes; a last line without its newline
    was cut by a kill and does not count).

    Raises:
        InputError: a complete line that is not an answer (naming it): the file is someone else's.
    """
    done = set()
    for number, line in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), start=1):
        try:
            answer = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            answer = None
        if not isinstance(answer, dict) or not set(ANSWER_KEYS) <= set(answer):
            raise InputError(f"output {short(str(path))} line {number} is not an answer of h2o-compress batch (it is "
                             "left as it is); allowed: a new file, or the output of an earlier run to resume")
        done.add(str(answer["id"]))
    return done


class AnswerFile:
    """OUTPUT, appended to one answer line at a time. Opening it reads the ids already answered (`done`, which
    then grows with each answer written), cuts a half-written last line (a run killed mid-write), and takes an
    exclusive lock (a second run on the same file is refused).

    Raises (when opened):
        InputError: OUTPUT is a directory, or the INPUT file itself, or holds a line that is not an answer (it is
            someone else's file: it is left as it is), or another run is writing it.
    """

    def __init__(self, path, input_path=None):
        self.path = Path(path)
        self.check(path, input_path)
        self.handle = open(self.path, "a+b")  # noqa: SIM115 - held open (and locked) for the run
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.handle.close()
            raise InputError(f"output {short(str(path))} is being written by another run; allowed: wait for it, "
                             "or another output file") from None
        self.handle.seek(0)
        data = self.handle.read()
        self.done = answered_ids(data, self.path)
        keep = data.rfind(b"\n") + 1  # complete lines end with "\n"; a last line without one was cut by a kill
        if keep < len(data):
            self.handle.truncate(keep)

    @staticmethod
    def check(path, input_path=None) -> set[str]:
        """The ids OUTPUT ``path`` already answers (none for a new file), read without changing anything: the checks
        of opening it, made before the model loads.

        Raises:
            InputError: as when opened (a directory, the input file, a folder that does not exist, a line that is
                not an answer).
        """
        path = Path(path)
        if path.is_dir():
            raise InputError(f"output {short(str(path))} is a directory; allowed: a file path (JSONL)")
        if input_path is not None and path.exists() and path.resolve() == Path(input_path).resolve():
            raise InputError(f"output {short(str(path))} is the input file; allowed: another file")
        if not path.parent.is_dir():
            raise InputError(f"output {short(str(path))}: folder {short(str(path.parent))} does not exist")
        if not path.exists():
            return set()
        if not path.is_file():
            raise InputError(f"output {short(str(path))} is not a regular file; allowed: a file path (JSONL)")
        return answered_ids(path.read_bytes(), path)

    def write(self, result: BatchResult) -> None:
        """Append ``result`` as one JSON line and flush it to the OS (it survives the process being killed); its id
        joins `done`."""
        self.handle.write((json.dumps(result.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))
        self.handle.flush()
        self.done.add(str(result.id))

    def close(self) -> None:
        """Sync the file to disk and release the lock."""
        if not self.handle.closed:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()

    def __enter__(self) -> AnswerFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
