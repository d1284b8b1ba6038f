"""The built-in corpus: English text that every CPython install carries, so training needs no download.

Two parts, each a list of documents in a fixed order:
- the reference-manual topics behind `help("with")` etc. (`pydoc_data.topics`, ~0.5 MB);
- the docstrings of a fixed list of standard-library modules (~1 MB): each module's own docstring
  and those of its public classes, functions and methods, dedented, one document per module.

The text depends on the Python version (and, slightly, the platform), never on the run: the corpus
sha256 keys every cache built from it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import warnings
from pathlib import Path

import sentencepiece as spm
import tokenizers

from llmkit.framework.files import cache_root as default_cache_dir
from llmkit.models.llama.tokenizer import TRAINER_SETTINGS, LlamaTokenizer, train_tokenizer
from llmkit.tokenizer import SPECIAL_MAP_FILE

# Pure-Python or always-built modules present on CPython 3.10+ on every platform, whose import has
# no side effects. Left out: modules that need optional C libraries (bz2, lzma, sqlite3, ssl,
# zlib, ...), platform-specific ones (os, socket, multiprocessing, ...) and deprecated ones.
STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        """
        _pydecimal abc argparse ast asyncio.base_events asyncio.events asyncio.locks
        asyncio.protocols asyncio.queues asyncio.streams asyncio.tasks asyncio.transports base64 bdb
        bisect builtins calendar cmd code codecs codeop collections collections.abc colorsys
        compileall concurrent.futures._base configparser contextlib copy csv dataclasses datetime
        difflib dis doctest email.charset email.feedparser email.generator email.header
        email.headerregistry email.message email.parser email.policy email.utils enum filecmp
        fileinput fnmatch fractions ftplib functools getopt gettext glob graphlib heapq hmac html
        html.parser http.client http.cookiejar http.server imaplib importlib.abc importlib.metadata
        importlib.util inspect io ipaddress itertools json json.decoder json.encoder keyword
        linecache logging logging.handlers mailbox math mimetypes modulefinder numbers operator
        optparse pathlib pdb pickle pickletools pkgutil plistlib poplib pprint profile pstats pydoc
        queue quopri random re runpy sched secrets shelve shlex shutil smtplib socketserver
        statistics string struct symtable tabnanny tarfile tempfile textwrap threading timeit
        tokenize trace traceback types typing unittest.case unittest.loader unittest.mock
        unittest.result urllib.parse urllib.request urllib.robotparser uuid warnings wave weakref
        wsgiref.handlers wsgiref.headers wsgiref.util wsgiref.validate xml.dom.minidom
        xml.etree.ElementTree xml.sax.handler xml.sax.xmlreader xmlrpc.client xmlrpc.server zipfile
        zipimport
        """.split()  # noqa: SIM905 (a word list reads better than 150 quoted strings)
    )
)

# Everything the builtin tokenizer depends on besides the corpus text and vocab size.
_TOKENIZER_KEY_SETTINGS = {
    "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    "sentencepiece": spm.__version__,
    "tokenizers": tokenizers.__version__,
    "trainer": TRAINER_SETTINGS,
}


@functools.lru_cache(maxsize=2)
def builtin_documents(include_docstrings: bool = True) -> tuple[str, ...]:
    """The corpus as documents: pydoc topics sorted by name, then one per module; no empties, no repeats."""
    from pydoc_data.topics import topics

    docs = [topics[name].strip("\n") for name in sorted(topics)]
    if include_docstrings:
        seen: set[str] = set()  # inherited and re-exported docstrings appear once
        docs += [_module_document(name, seen) for name in STDLIB_MODULES]
    # Some topics are aliases with the same text; keep the first of each.
    return tuple(dict.fromkeys(doc for doc in docs if doc))


def builtin_corpus(include_docstrings: bool = True) -> str:
    """The built-in corpus as one string: `builtin_documents` separated by blank lines."""
    return "\n\n".join(builtin_documents(include_docstrings))


def builtin_corpus_sha256(include_docstrings: bool = True) -> str:
    return hashlib.sha256(builtin_corpus(include_docstrings).encode("utf-8")).hexdigest()


def builtin_tokenizer(
    vocab_size: int = 4096, cache_dir: str | os.PathLike[str] | None = None, kind: str = "sentencepiece"
) -> LlamaTokenizer:
    """A tokenizer of ``kind`` (``train_tokenizer``'s) trained on the built-in corpus, cached on
    disk after the first call.

    The cache entry `<cache_dir>/tokenizers/builtin-<key>/` (the tokenizer's files, special_tokens_map.json
    written last) is keyed by the Python version, the corpus sha256, vocab_size, kind, the
    sentencepiece and tokenizers versions and the trainer settings.
    """
    settings = {**_TOKENIZER_KEY_SETTINGS, "corpus": builtin_corpus_sha256(), "vocab_size": vocab_size}
    settings["kind"] = kind
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"builtin-{key}"
    if (directory / SPECIAL_MAP_FILE).is_file():
        return LlamaTokenizer.from_pretrained(directory)
    return train_tokenizer(builtin_documents(), vocab_size, directory, kind=kind)


def _module_document(name: str, seen: set[str]) -> str:
    """Docstrings of module `name` and of its public classes, functions and methods, in name order.

    Pure-Python modules are read from their source with `ast`, so the text cannot depend on what the
    running process imported or patched (libraries do wrap stdlib functions); modules built in C
    have no source and are read from their live objects.
    """
    spec = importlib.util.find_spec(name)
    if spec is None:  # a stripped-down Python build; the corpus hash records the difference
        return ""
    if spec.origin and spec.origin.endswith(".py"):
        docs = _source_docstrings(Path(spec.origin).read_text(encoding="utf-8"))
    else:
        docs = _live_docstrings(name)
    kept = []
    for doc in docs:
        if doc and doc not in seen:
            seen.add(doc)
            kept.append(doc)
    return "\n\n".join(kept)


def _source_docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = [ast.get_docstring(tree) or ""]
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in sorted((n for n in tree.body if isinstance(n, defs)), key=lambda n: n.name):
        if node.name.startswith("_"):
            continue
        docs.append(ast.get_docstring(node) or "")
        if isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for m in sorted(methods, key=lambda m: m.name):
                if not m.name.startswith("_") or m.name == "__init__":
                    docs.append(ast.get_docstring(m) or "")
    return docs


def _live_docstrings(name: str) -> list[str]:
    with warnings.catch_warnings():  # deprecated modules and attributes warn on access
        warnings.simplefilter("ignore")
        module = importlib.import_module(name)
        # Only objects defined here (by __module__), so re-exports are not walked twice.
        objects: list[object] = [module]
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj):
                objects.append(obj)
                objects += [m for a, m in sorted(vars(obj).items()) if _is_public_method(a, m)]
            elif inspect.isroutine(obj):
                objects.append(obj)
    docs = [getattr(obj, "__doc__", None) for obj in objects]
    return [inspect.cleandoc(doc) if isinstance(doc, str) else "" for doc in docs]


def _is_public_method(name: str, member: object) -> bool:
    if name.startswith("_") and name != "__init__":
        return False
    return inspect.isroutine(member) or isinstance(member, (property, classmethod, staticmethod))
