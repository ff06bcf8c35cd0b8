"""What every ``attnkit`` command shares: the parser class, the argument types and the escaping of untrusted
text (defined in :mod:`attnkit._arguments`, which the torchrun trainer uses too), the checks of output paths,
JSON output, and the one error handler that turns failures into exit codes.

Exit codes (:func:`run_command`): 0 success; 1 a missing optional dependency (the message names the install
command) or an internal error; 2 a bad command line or bad input files, reported as one line on stderr,
never a traceback; 130 interrupted; 141 (128 + SIGPIPE, as a Unix tool killed by it) when the reader of stdout
went away (``attnkit generate ... | head -c1``), quietly. A stdout closed before the start (``>&-``) takes
the output as ``/dev/null`` would. ``ATTNKIT_TRACEBACK=1`` in the environment shows the traceback of an
internal error instead of its one line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from .._arguments import (
    _SHOWN_CHARS,
    Parser,
    UsageError,
    bounded_int,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    printable,
)
from ..io import atomic_write

__all__ = ["PROG", "query_labels", "write_explorer",
           "UsageError", "Parser", "bounded_int", "positive_int", "non_negative_int", "positive_float",
           "non_negative_float",
           "output_folder", "output_file", "printable", "check_argv_text", "check_utf8", "tolerant_input",
           "unescape", "escaped_text", "ESCAPES",
           "require_matplotlib", "save_figure",
           "run_command", "IMAGE_SUFFIXES", "json_text", "model_types_text", "add_threads_argument", "use_threads",
           "add_quiet_argument", "progress_of", "add_dtype_argument", "MODEL_DTYPES"]

PROG = "attnkit"
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
_DPI = 100  # pictures are exactly figsize * 100 pixels
_MESSAGE_CHARS = 500  # longest error message (a 5000-character path is cut)

# -- untrusted text --------------------------------------------------------------------------------------
# What JSON leaves raw but a terminal acts on: DEL and C1 controls, line/paragraph separators, bidirectional
# overrides and isolates, lone surrogates (json escapes C0 itself).
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def json_text(record: Any) -> str:
    r"""``record`` as one line of JSON, readable (non-ASCII text kept) but with every character a terminal
    would act on written as a ``\uXXXX`` escape (still the same JSON value).

    Examples
    --------
    >>> print(json_text({"text": "a" + chr(0x202E) + "b" + chr(0x85) + " é"}))
    {"text": "a\u202eb\u0085 é"}
    """
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(record, ensure_ascii=False))


def check_utf8(text: str, what: str, prog: str = PROG) -> str:
    """``text`` itself, or a :class:`UsageError` of ``prog`` when it holds bytes that are not UTF-8 (Python hands
    such bytes over as lone surrogates: from ``sys.argv``, and from a stream read with ``surrogateescape``).

    Examples
    --------
    >>> check_utf8("caf\u00e9", "the message")
    'caf\u00e9'
    >>> check_utf8("a" + chr(0xDCFF), "the message")
    Traceback (most recent call last):
    attnkit._arguments.UsageError: the message is not UTF-8 text: byte 0xff at character 2
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"the lone surrogate U+{bad:04X}"
        raise UsageError(f"{what} is not UTF-8 text: {byte} at character {exc.start + 1}", prog) from None
    return text


def check_argv_text(argv: Sequence[str]) -> None:
    """Raise :class:`UsageError` for an argument that is not valid UTF-8 (Python hands such bytes over as
    lone surrogates, which cannot be printed or written back)."""
    for position, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")  # bytes as \xff
            shown = printable(shown, _SHOWN_CHARS)
            raise UsageError(f"argument {position} ({shown}) is not valid UTF-8 text") from None


def tolerant_input(stream: TextIO) -> TextIO:
    """``stream`` set to hand bytes that are not UTF-8 over as lone surrogates instead of raising in the middle
    of a read, so that :func:`check_utf8` can name them (streams that cannot be reconfigured are kept as they
    are)."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):
            pass
    return stream


# -- model loading ---------------------------------------------------------------------------------------
def add_keep_quantized_argument(parser: Any) -> None:
    """Add ``--keep-quantized`` to a command that loads a causal LM (``load(..., keep_quantized=True)``)."""
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep a GGUF file's quantized weights (and gpt-oss's MXFP4 experts) packed in memory: "
                             "about the file's size instead of 4-8x it, each token slower (every product "
                             "dequantizes its weight a block at a time)")


# -- escapes in text flags ------------------------------------------------------------------------------
# What llama.cpp's ``-p``/``--prompt`` and ``--reverse-prompt`` take (common.cpp's string_process_escapes), with
# \uXXXX added; said in every text flag's help.
ESCAPES = r'escapes: \n \r \t \\ \" \' \uXXXX'
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
_HEX4 = re.compile("[0-9a-fA-F]{4}")


def unescape(text: str) -> str:
    r"""``text`` with its backslash escapes replaced: ``\n``, ``\r``, ``\t``, ``\\``, ``\"``, ``\'`` and
    ``\uXXXX`` (a surrogate pair of two ``\u`` escapes is one character), as llama.cpp reads its text flags.

    Raises
    ------
    ValueError
        Any other escape, a backslash at the end, or a ``\u`` escape that is not four hexadecimal digits or is
        a lone surrogate (which is not text), naming the character where it starts.

    Examples
    --------
    >>> unescape(r"a\n\tb \"q\" caf\u00e9 \ud83d\ude00 \\n")
    'a\n\tb "q" café 😀 \\n'
    >>> unescape(r"C:\dir")
    Traceback (most recent call last):
    ValueError: invalid escape \d at character 3 (escapes: \n \r \t \\ \" \' \uXXXX; \\ writes a backslash)
    """
    if "\\" not in text:
        return text
    out: list[str] = []
    i = 0
    while i < len(text):
        j = text.find("\\", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        code, i = _escape_at(text, j)
        out.append(code)
    return "".join(out)


def _escape_at(text: str, j: int) -> tuple[str, int]:
    """The character the escape starting at ``text[j]`` (a backslash) stands for, and where the text goes on."""
    where = f"at character {j + 1} ({ESCAPES}; \\\\ writes a backslash)"
    if j + 1 == len(text):
        raise ValueError(f"a backslash ends the text {where}")
    letter = text[j + 1]
    if letter in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[letter], j + 2
    if letter != "u":
        raise ValueError(f"invalid escape \\{printable(letter)} {where}")
    code = _hex4(text, j, where)
    if 0xD800 <= code <= 0xDBFF and text.startswith("\\u", j + 6):  # a pair, as JSON writes 😀
        low = _hex4(text, j + 6, where)
        if 0xDC00 <= low <= 0xDFFF:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), j + 12
    if 0xD800 <= code <= 0xDFFF:
        raise ValueError(f"\\u{code:04x} is a lone surrogate, not a character, {where}")
    return chr(code), j + 6


def _hex4(text: str, j: int, where: str) -> int:
    digits = text[j + 2:j + 6]
    if not _HEX4.fullmatch(digits):
        raise ValueError(f"\\u needs four hexadecimal digits, got {printable(repr(digits))} {where}")
    return int(digits, 16)


def escaped_text(text: str) -> str:
    """An argparse type: text with the escapes of :func:`unescape` (an invalid one is a usage error that names
    the flag)."""
    try:
        return unescape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


escaped_text.__name__ = "text"


# -- threads ---------------------------------------------------------------------------------------------
def add_threads_argument(parser: Any) -> None:
    """Add ``--threads N`` to a command that runs a model (:func:`use_threads` applies it)."""
    from ..kernels._threads import MAX_NUM_THREADS, default_num_threads, thread_count_argument

    parser.add_argument("--threads", type=thread_count_argument, default=None, metavar="N",
                        help=f"threads of attnkit's kernels and of BLAS, 1 to {MAX_NUM_THREADS} (default: every core "
                             f"this process may use, {default_num_threads()} here)")


def use_threads(threads: int | None) -> None:
    """Run attnkit's kernels (:func:`attnkit.set_num_threads`) and NumPy's BLAS (through ``threadpoolctl``) on
    ``threads`` threads for the rest of the process; None leaves both at their defaults. Without
    ``threadpoolctl`` (the ``fast`` extra) BLAS keeps its own count, and a note on stderr says so."""
    if threads is None:
        return
    from ..kernels._threads import set_num_threads

    set_num_threads(threads)
    if importlib.util.find_spec("threadpoolctl") is None:
        print(f"note: threadpoolctl is not installed, so --threads {threads} sets attnkit's threads but not BLAS's "
              f"(pip install 'attnkit[fast]', or set OPENBLAS_NUM_THREADS)", file=sys.stderr)
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")  # kept: the limit holds until the process ends


# -- progress --------------------------------------------------------------------------------------------
def add_quiet_argument(parser: Any) -> None:
    """Add ``--quiet`` to a command with long waits (:func:`progress_of` reads it)."""
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (they show only when stderr is a terminal)")


def progress_of(args: Any) -> bool | None:
    """The ``progress=`` argument of a command's long steps: False with ``--quiet``, else None (a line on stderr
    when it is a terminal, nothing on a pipe or in a file; :mod:`attnkit._progress`)."""
    return False if args.quiet else None


# -- the model's dtype -----------------------------------------------------------------------------------
MODEL_DTYPES = ("float32", "float64", "float16")  # what load_causal_lm computes in; float32 first: the default


def add_dtype_argument(parser: Any, choices: Sequence[str] = MODEL_DTYPES) -> None:
    """Add ``--dtype`` to a command that loads a causal LM: the weights' and computations' dtype, one of
    ``choices`` (default float32), given to :func:`attnkit.pretrained.load_causal_lm` as a NumPy dtype. NumPy
    has no bfloat16: ``bfloat16`` is refused saying so (BF16 weights load into any of the choices)."""
    def parse(text: str) -> Any:
        import numpy as np

        if text not in choices:
            why = " (NumPy has no bfloat16; BF16 weights load into any of these)" if text == "bfloat16" else ""
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got "
                                             f"{printable(repr(text), _SHOWN_CHARS)}{why}")
        return np.dtype(text)

    parse.__name__ = "dtype"
    parser.add_argument("--dtype", type=parse, default="float32", metavar="DTYPE",
                        help=f"dtype of the weights and computations: {', '.join(choices)} (default float32)")


# -- output paths ----------------------------------------------------------------------------------------
def output_folder(path: str | Path) -> Path:
    """Create ``path`` if needed and make sure a file can be written in it (else :class:`UsageError`)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".attnkit-write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write to the output folder {printable(repr(str(folder)))}: "
                         f"{printable(exc.strerror or exc)}") from None
    return folder


def output_file(path: str | Path, suffixes: Sequence[str] = IMAGE_SUFFIXES, prog: str = PROG,
                option: str = "the output file") -> Path:
    """Check that a file with one of ``suffixes`` can be written at ``path``: the one rule of every command's
    output paths. Missing folders are created; a path that exists must be a regular file (it is replaced
    atomically), not a folder, a FIFO, a device or a socket."""
    file = Path(path)
    shown = printable(repr(str(file)))
    if file.suffix.lower() not in suffixes:
        raise UsageError(f"{option} must end in one of {', '.join(suffixes)}, got {shown}", prog)
    if file.is_dir():
        raise UsageError(f"{option} {shown} is a folder", prog)
    if file.exists() and not file.is_file():
        raise UsageError(f"{option} {shown} exists and is not a regular file (a FIFO, a device or a socket); "
                         f"attnkit writes files by replacing them, which would not reach its reader", prog)
    output_folder(file.parent)
    return file


# -- pictures --------------------------------------------------------------------------------------------
def require_matplotlib(what: str) -> None:
    """Raise the one-line ImportError of a missing ``viz`` extra, before any work is done."""
    if importlib.util.find_spec("matplotlib") is None:
        from ..viz import VIZ_INSTALL_HINT

        raise ImportError(f"{what} needs matplotlib, which is not installed: {VIZ_INSTALL_HINT}")


def save_figure(fig: Any, path: Path, dpi: int = _DPI) -> None:
    """Write ``fig`` to ``path`` atomically (a temporary file in the same folder, then renamed) and close it,
    so an interrupted run never leaves half a picture behind."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format=path.suffix.lstrip(".").lower() or None))
    finally:
        plt.close(fig)


# -- the one error handler -------------------------------------------------------------------------------
def _say(prog: str, message: Any) -> None:
    print(f"{printable(prog, _SHOWN_CHARS)}: error: {printable(message, _MESSAGE_CHARS)}", file=sys.stderr, flush=True)


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141: what a shell reports for a tool that SIGPIPE ended


def _discard_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` so that the interpreter's final flush of what is still
    buffered cannot raise a second ``BrokenPipeError`` (Python's recommended handling of SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a capture in tests): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def run_command(run: Callable[[], int], prog: str = PROG) -> int:
    """Call ``run()`` and turn what it raises into one line on stderr and an exit code (see module doc)."""
    closed = sys.stdout is None  # started with stdout closed: print() already drops what it is given
    if closed:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        code = int(run() or 0)
        sys.stdout.flush()  # inside the handler: a reader that left shows here, not at exit
        return code
    except BrokenPipeError:  # the reader of stdout went away: nothing is wrong, stop quietly
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except UsageError as exc:
        _say(exc.prog, exc)
        return 2
    except ImportError as exc:
        if "pip install" not in str(exc):  # a broken install rather than a missing extra
            return _internal_error(prog, exc)
        _say(prog, exc)
        return 1
    except MemoryError:
        _say(prog, "not enough memory for this command (try smaller sizes)")
        return 2
    except OSError as exc:  # unreadable or unwritable files that no earlier check caught
        where = f" ({printable(exc.filename)})" if exc.filename is not None else ""
        _say(prog, f"{exc.strerror or exc}{where}")
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the command line shows no tracebacks
        return _internal_error(prog, exc)
    finally:
        if closed:
            sys.stdout.close()
            sys.stdout = None


def _internal_error(prog: str, exc: BaseException) -> int:
    if os.environ.get("ATTNKIT_TRACEBACK"):
        raise exc
    _say(prog, f"internal error: {type(exc).__name__}: {printable(exc, 300)} "
               f"(run with ATTNKIT_TRACEBACK=1 for the traceback and please report it)")
    return 1


def model_types_text(last: str = "or") -> str:
    """The model_types attnkit loads, as a phrase for help and messages ("gemma2, ..., qwen3 or smollm3"): read
    from the families' registry, so the help names every family it loads."""
    from ..pretrained.families import model_types

    names = model_types()
    return ", ".join(names[:-1]) + f" {last} " + names[-1]


def query_labels(ids: Sequence[int], outputs: Sequence[int], tokens: Sequence[str]) -> list[str]:
    """Row labels ``"input -> output"``: what each position reads and what the model writes there."""
    return [f"{tokens[i]}\u2192{tokens[o]}" for i, o in zip(ids, outputs)]


def write_explorer(tokens: list[str], weights: object, path: Path, title: str, layer_names: list[str],
                   head_names: list[str], **kwargs: object) -> None:
    """Write the interactive explorer page of (N, H, Lq, Lk) ``weights`` and say so (``kwargs`` go to
    ``attention_html``: ``raw_tokens``, ``query_tokens``...)."""
    import warnings

    from ..viz import attention_html

    with warnings.catch_warnings(record=True) as caught:  # the terminal gets one sentence, not a Python warning
        warnings.simplefilter("always")
        attention_html(tokens, weights, path, title=title, layer_names=layer_names, head_names=head_names,
                       **kwargs)
    size = Path(path).stat().st_size / 1e6
    bits = _page_bits(Path(path))
    detail = "" if bits in (None, 8) else f", {bits} bits per weight to stay under 5 MB"
    print(f"wrote {printable(path)} ({size:.1f} MB{detail}; interactive: open it in a browser)")
    if caught:
        print("note: the page is large and opens slowly; --layer I and --head J make it smaller")


def _page_bits(path: Path) -> int | None:
    """The bits per attention weight a page stored (the number follows ``"bits":`` in its data)."""
    import re

    with open(path, encoding="utf-8") as f:
        match = re.search(r'"attention":\{"bits":(\d)', f.read())
    return int(match.group(1)) if match else None
