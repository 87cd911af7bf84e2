"""The files of ``h2o-compress batch``: the prompts it reads (JSONL or plain text) and the answers it appends.

- `read_requests`: INPUT as request dicts, a malformed line as an error result naming its line, before
  anything runs; a file that is not text at all (binary, not UTF-8, a directory) is refused as a whole. Lines end
  at ``\\n`` (or ``\\r\\n``) only: JSON strings may hold U+2028 and U+0085 (and a raw tab or form feed is read as
  it is). Every line gets an id no other line has, so each answer is matched to exactly one prompt (resume).
- `AnswerFile`: OUTPUT, opened for appending only (never replaced, never truncated beyond a half-written last
  answer line), locked against a second run, each answer written as one line and flushed: a killed run loses
  nothing it answered, and a rerun skips the ids already there (resume). A file holding anything but answer lines
  (each value of the type an answer has), and at its end at most the start of one, is refused and left as it is.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import json
import os
import string
from dataclasses import replace
from pathlib import Path

from h2o_compress.runtime.batch_requests import FINISH_REASONS, REQUEST_KEYS, BatchResult
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import InputError, short, write_failure
from h2o_compress.utils.files import MAX_TEXT_BYTES, read_text, write_all

#: The keys every answer line has (and ``error`` where ``finish_reason`` is ``error``).
ANSWER_KEYS = ("id", "text", "prompt_tokens", "new_tokens", "finish_reason")
#: Names read as JSONL whatever their first line; ``.txt`` is always text; another name is JSONL when its first
#: line that is not blank opens with ``{``.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt",)


def read_requests(path) -> list[dict | BatchResult]:
    """The requests of INPUT ``path``, one per line (lines end at ``\\n`` or ``\\r\\n``; a UTF-8 BOM is dropped).

    JSONL (a ``.jsonl`` or ``.ndjson`` file, or one not named ``.txt`` whose first line opens with ``{``) gives each
    line's object (keys `REQUEST_KEYS`; ``id`` defaults to the line number); plain text gives each line as a prompt,
    its id the line number. A line that is empty, not a JSON object or repeats an earlier id becomes an error
    result naming its line. Ids are unique: an error result takes its own id (or its line number) unless another
    line has it, else ``line N`` (`_assign_ids`).

    Raises:
        InputError: the file is missing, not a regular file, larger than 256 MiB, not UTF-8 text (binary), or holds
            no line at all.
    """
    text = read_text(path, "input file", InputError, limit=MAX_TEXT_BYTES)
    if "\x00" in text:
        raise InputError(f"input file {short(str(path))} holds NUL bytes: it is binary, not JSONL or text; allowed: "
                         "a JSONL file (one JSON object per line) or a text file (one prompt per line)")
    lines = split_lines(text.removeprefix("\ufeff"))
    if not any(line.strip() for line in lines):
        raise InputError(f"input file {short(str(path))} holds no prompt; allowed: one prompt per line")
    as_json = is_jsonl(path, lines)
    return _assign_ids([_parse_line(line, number, as_json) for number, line in enumerate(lines, start=1)])


def split_lines(text: str) -> list[str]:
    """The lines of ``text``: split at ``\\n`` only (a ``\\r`` before it dropped), never at the other characters
    ``str.splitlines`` takes for line ends (U+2028, U+0085, form feeds...), which JSON strings may hold; a final
    ``\\n`` ends the last line, it does not open an empty one."""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines and not lines[-1]:
        lines.pop()
    return lines


def is_jsonl(path, lines: list[str]) -> bool:
    """Whether INPUT ``path`` (its ``lines``) is read as JSONL: by its name (`JSONL_SUFFIXES`, `TEXT_SUFFIXES`),
    else when its first line that is not blank opens with ``{``."""
    suffix = Path(str(path)).suffix.lower()
    if suffix in JSONL_SUFFIXES or suffix in TEXT_SUFFIXES:
        return suffix in JSONL_SUFFIXES
    return next(line for line in lines if line.strip()).lstrip().startswith("{")


def _parse_line(line: str, number: int, as_json: bool) -> dict | BatchResult:
    """Line ``number`` as a request dict (its ``id`` a text: its own or its line number) or an error result."""
    if not line.strip():
        return _error(number, f"line {number} is empty; allowed: a prompt on every line")
    if not as_json:
        return {"id": str(number), "prompt": line}
    try:
        value = json.loads(line, strict=False)  # strict=False: a raw tab or form feed inside a string is kept
    except (ValueError, RecursionError) as exc:  # ValueError: also an integer of more than 4300 digits
        reason = "nested too deeply" if isinstance(exc, RecursionError) else getattr(exc, "msg", "a number too long")
        return _error(number, f"line {number} is not JSON ({reason}); allowed: one JSON object per line")
    if not isinstance(value, dict):
        return _error(number, f"line {number} is a JSON {type(value).__name__}, not an object; allowed: "
                              f"{{\"id\": ..., \"prompt\": \"...\"}}")
    unknown = sorted(set(value) - set(REQUEST_KEYS))
    if unknown:
        return _error(number, f"line {number}: unknown key {', '.join(map(repr, unknown))}; allowed: "
                              f"{', '.join(REQUEST_KEYS)}", value.get("id"))
    ident = value.get("id", number)
    if not (isinstance(ident, str) or is_integer(ident)):
        return _error(number, f"line {number}: id {short(ident)} is invalid; allowed: a text or an integer")
    value["id"] = str(ident)
    return value


def _error(number: int, message: str, ident=None) -> BatchResult:
    ident = str(ident) if isinstance(ident, str) or is_integer(ident) else str(number)
    return BatchResult(id=ident, index=number - 1, finish_reason="error", error=message)


def _assign_ids(parsed: list[dict | BatchResult]) -> list[dict | BatchResult]:
    """``parsed`` (line 1 first) with ids no two lines share, so that each answer in OUTPUT is one line's and a
    resumed run answers every line exactly once.

    A request keeps its id unless an earlier request has it (then it is an error result: a repeated id). Requests
    are served first, so an error line never takes the id of a request, even a later one. An error result keeps its
    id (its own, else its line number) while no line has it, else takes ``line N`` (``line N (2)``... while that is
    taken too).
    """
    holder: dict[str, int] = {}  # id -> the line of the request that has it
    for number, item in enumerate(parsed, start=1):
        if isinstance(item, dict):
            holder.setdefault(item["id"], number)
    taken = set(holder)
    out: list[dict | BatchResult] = []
    for number, item in enumerate(parsed, start=1):
        if isinstance(item, dict) and holder[item["id"]] == number:
            out.append(item)
            continue
        wanted = str(number) if isinstance(item, dict) else item.id
        ident, copy = wanted, 1
        while ident in taken:
            copy += 1
            ident = f"line {number}" if copy == 2 else f"line {number} ({copy - 1})"
        taken.add(ident)
        if isinstance(item, dict):
            item = _error(number, f"line {number}: id {short(item['id'])} repeats line {holder[item['id']]}; allowed: "
                                  "one line per id (answers are matched to prompts by id; this one is answered as id "
                                  f"{ident!r})", ident)
        out.append(item if item.id == ident else replace(item, id=ident))
    return out


def answer_problem(answer) -> str | None:
    """What makes ``answer`` (a parsed OUTPUT line) not an answer `AnswerFile.write` writes, or ``None``: it must be
    an object with exactly `ANSWER_KEYS` (and ``error``, a text, where ``finish_reason`` is ``error``), ``id`` and
    ``text`` texts, token counts integers >= 0 and ``finish_reason`` one of `FINISH_REASONS`."""
    if not isinstance(answer, dict):
        return f"a JSON {type(answer).__name__}, not an object"
    wanted = set(ANSWER_KEYS) | ({"error"} if answer.get("finish_reason") == "error" else set())
    if set(answer) != wanted:
        odd = sorted(set(answer) ^ wanted)
        return f"key {', '.join(map(repr, odd))} {'missing' if set(odd) <= wanted else 'unexpected'}"
    for key in ("id", "text", "error"):
        if key in answer and not isinstance(answer[key], str):
            return f"{key} {short(answer[key], 40)} is not a text"
    for key in ("prompt_tokens", "new_tokens"):
        value = answer[key]
        if not is_integer(value) or value < 0:
            return f"{key} {short(value, 40)} is not an integer >= 0"
    if answer["finish_reason"] not in FINISH_REASONS:
        return f"finish_reason {short(answer['finish_reason'], 40)} is not one of {', '.join(FINISH_REASONS)}"
    return None


# The fields of an answer line as json.dumps writes `BatchResult.to_dict` (texts: "S", counts: "N").
_LINE = ('{"id": ', "S", ', "text": ', "S", ', "prompt_tokens": ', "N", ', "new_tokens": ', "N",
         ', "finish_reason": ', "S")
_ERROR_FIELD = (', "error": ', "S")


def _string_end(text: str, start: int) -> int | None:
    """Where the JSON string opening at ``text[start]`` (a ``"``) ends (just past its closing quote), ``len(text)``
    when ``text`` stops inside it, or ``None`` when it holds what no JSON string holds (a control character, a bad
    escape)."""
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == '"':
            return i + 1
        if ord(char) < 0x20:
            return None
        if char == "\\":
            escape = text[i + 1:i + 2]
            if escape == "u":
                digits = text[i + 2:i + 6]
                if not all(d in string.hexdigits for d in digits):
                    return None
                i += 2 + len(digits)
                continue
            if escape and escape not in '"\\/bfnrt':
                return None
            i += 2
            continue
        i += 1
    return len(text)


def is_cut_answer(tail: bytes) -> bool:
    """Whether ``tail`` (OUTPUT's bytes after its last newline) is the start of an answer line a killed run left
    half-written: a prefix of ``json.dumps(BatchResult.to_dict())`` (UTF-8, possibly cut inside a character),
    never anything else (a user's text, JSON or binary file without a final newline)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(tail, final=False)
        whole = json.loads(text)
    except UnicodeDecodeError:
        return False
    except (ValueError, RecursionError):
        whole = None
    if whole is not None:  # the whole line but its newline: it must be an answer
        return answer_problem(whole) is None
    i = 0
    for part in (*_LINE, *_ERROR_FIELD):
        if i >= len(text):
            return True
        if part == "S":
            if text[i] != '"' or (end := _string_end(text, i)) is None:
                return False
            i = end
        elif part == "N":
            end = i
            while end < len(text) and text[end] in string.digits:
                end += 1
            if end == i or (text[i] == "0" and end > i + 1):
                return False
            i = end
        elif text[i:i + len(part)] != part[:len(text) - i]:
            return part == _ERROR_FIELD[0] and text[i:] == "}"  # the line's end, cut before its newline
        else:
            i += len(part)
    return text[i:] in ("", "}")


def answered_ids(data: bytes, path) -> set[str]:
    """The ids of the complete answer lines of ``data`` (an OUTPUT file's bytes; a last line without its newline
    was cut by a kill and does not count).

    Raises:
        InputError: a complete line that is not an answer (`answer_problem`), or a last line without its newline that
            is not the start of one (`is_cut_answer`), naming it: the file is someone else's.
    """
    cut = data.rfind(b"\n") + 1
    lines = data[:cut].split(b"\n")[:-1]
    done = set()
    for number, line in enumerate(lines, start=1):
        try:
            answer = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):  # not JSON, not UTF-8, an integer of more than 4300 digits
            answer = _NOT_JSON
        problem = "not JSON" if answer is _NOT_JSON else answer_problem(answer)
        if problem is not None:
            raise _not_answers(path, number, problem)
        done.add(answer["id"])
    if cut < len(data) and not is_cut_answer(data[cut:]):
        raise _not_answers(path, len(lines) + 1, "nor the start of one, as a killed run leaves it")
    return done


_NOT_JSON = object()


def _not_answers(path, number: int, problem: str) -> InputError:
    return InputError(f"output {short(str(path))} line {number} is not an answer of h2o-compress batch ({problem}); "
                      "it is left as it is; allowed: a new file, or the output of an earlier run to resume")


class AnswerFile:
    """OUTPUT, appended to one answer line at a time. Opening it reads the ids already answered (`done`, which
    then grows with each answer written), cuts a half-written last answer line (a run killed mid-write), and takes
    an exclusive lock (a second run on the same file is refused).

    Raises (when opened):
        InputError: OUTPUT is a directory, or the INPUT file itself, or holds anything but answer lines (it is
            someone else's file: it is left as it is, also when it has no final newline), or another run is
            writing it.
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
        try:
            self.handle.seek(0)
            data = self.handle.read()
            self.done = answered_ids(data, self.path)  # read again under the lock, before anything is cut
        except BaseException:
            self.handle.close()
            raise
        keep = data.rfind(b"\n") + 1  # complete lines end with "\n"; what follows is the start of an answer
        if keep < len(data):
            self.handle.truncate(keep)

    @staticmethod
    def check(path, input_path=None) -> set[str]:
        """The ids OUTPUT ``path`` already answers (none for a new file), read without changing anything: the checks
        of opening it, made before the model loads.

        Raises:
            InputError: as when opened (a directory, the input file, a folder that does not exist, a symbolic link
                to nothing, anything but answer lines).
        """
        path = Path(path)
        if path.is_dir():
            raise InputError(f"output {short(str(path))} is a directory; allowed: a file path (JSONL)")
        if input_path is not None and path.exists() and path.resolve() == Path(input_path).resolve():
            raise InputError(f"output {short(str(path))} is the input file; allowed: another file")
        if not path.parent.is_dir():
            raise InputError(f"output {short(str(path))}: folder {short(str(path.parent))} does not exist")
        if path.is_symlink() and not path.exists():
            raise InputError(f"output {short(str(path))} is a symbolic link to {short(os.readlink(path))}, which does "
                             "not exist; allowed: a new file, or the output of an earlier run to resume")
        if not path.exists():
            return set()
        if not path.is_file():
            raise InputError(f"output {short(str(path))} is not a regular file; allowed: a file path (JSONL)")
        return answered_ids(path.read_bytes(), path)

    def write(self, result: BatchResult) -> None:
        """Append ``result`` as one JSON line, handed to the OS at once (it survives the process being killed); its id
        joins `done`.

        Raises:
            InputError: the line cannot be written (a full disk, a file size limit): one line naming OUTPUT and the
                bytes the answer needs; OUTPUT is cut back to the answers before it (no half line is left).
        """
        line = (json.dumps(result.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
        fd = self.handle.fileno()  # opened for appending: each write goes to the end
        try:
            end = os.fstat(fd).st_size
            write_all(fd, line)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise InputError(f"{write_failure(self.path, exc, len(line), 'output')} (the answers before it are kept; "
                             "rerun the same command to resume)") from None
        self.done.add(str(result.id))

    def close(self, quiet: bool = False) -> None:
        """Sync the file to disk and release the lock.

        Raises:
            InputError: the sync failed (a full disk), unless ``quiet`` (another error is already on its way).
        """
        if self.handle.closed:
            return
        try:
            self.handle.flush()
            os.fsync(self.handle.fileno())
        except OSError as exc:
            if not quiet:
                raise InputError(write_failure(self.path, exc, what="output")) from None
        finally:
            with contextlib.suppress(OSError):
                self.handle.close()

    def __enter__(self) -> AnswerFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close(quiet=exc[0] is not None)
