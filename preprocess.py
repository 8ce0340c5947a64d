"""Turn text into the token shards the trainers memory-map: byte-level BPE, Arrow files, meta.json.

Run it (no arguments: this Python's own standard library, some 30 MB of *.py, into data.dir of
config.yaml):
    python preprocess.py
    python preprocess.py --input my_texts/ more.jsonl --out data/mine     # your own corpus

Read `main()` first (the end of the text path), then `write_shards()`, which makes the layout the
trainers rely on: train-00000.arrow, ..., val-00000.arrow are Arrow IPC files with one row per
document in one column `input_ids`; a row holds the document's token ids FOLLOWED BY the end-of-text
id, so the column's flat values buffer is already the causal-LM token stream with separators.
meta.json says how it was all made; token_frequencies.npy holds how often each token id occurs in
the train split (int64, one per id).

Images for classification are the block at the end (# images):
    python preprocess.py --images                                   # scikit-learn's digits
    python preprocess.py --images my_photos/ --out data/photos      # one sub-folder per class
There a row is one image, column `pixels` (S*S*3 bytes: rows, columns, RGB) and `label` (int32);
meta.json adds the class names and the train split's mean and std per channel.
"""
import argparse
import codecs
import errno
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FORMAT_VERSION = 1
# when config.yaml is absent
DEFAULTS = {"dir": "data/stdlib", "vocab_size": 8192, "val_fraction": 0.02}
# Per role, the names tokenizers use for it. The first is ours: a tokenizer we train gets them in
# this order (eot=0, pad=1, mask=2, cls=3, sep=4); in a loaded one the first name it knows wins.
SPECIAL_TOKEN_NAMES = {
    "eot": ["<|endoftext|>", "</s>", "<eos>", "[SEP]"],
    "pad": ["<|pad|>", "<pad>", "[PAD]"],
    "mask": ["<|mask|>", "<mask>", "[MASK]"],
    "cls": ["<|cls|>", "<s>", "[CLS]"],
    "sep": ["<|sep|>", "</s>", "[SEP]"],
}
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
JSON_LINES_SUFFIXES = (".jsonl", ".json")  # datasets' to_json() writes JSON Lines as .json
MAX_VOCAB_SIZE = 2**24
LONG_RUN = 10_000  # characters without a space: BPE training cuts such a word there
# per encode batch: bounds memory whatever the corpus size
CHUNK_DOCUMENTS, CHUNK_BYTES = 10_000, 4_000_000
PROGRESS_EVERY_S = 2.0
# A val split below either gets a warning: its loss would rest on a handful of texts.
TINY_VAL_DOCUMENTS, TINY_VAL_TOKENS = 20, 10_000


def die(message):
    """For every foreseeable mistake: what is wrong -> how to fix it, one stderr line, exit 2."""
    say("error: " + str(message).replace("\n", " "), file=sys.stderr)
    sys.exit(2)


def say(*values, file=None):
    """print, except that a reader who leaves early (`| head`) does not end the work."""
    try:
        print(*values, file=file, flush=True)
    except BrokenPipeError:  # later lines go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), (file or sys.stdout).fileno())


# ---- 1. inputs: which files, which documents, under which keys -----------------------------------

def stdlib_sources():
    """The default corpus as (root, file) pairs: the stdlib's *.py files by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        # pruned, not filtered afterwards: site-packages can hold ten times the stdlib's files
        subdirectories[:] = [name for name in subdirectories if name != "site-packages"]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return [(root, p) for p in sorted(files, key=lambda p: p.relative_to(root).as_posix())
            if p.is_file()]


def list_sources(paths, extensions):
    """(root, file) pairs: a file as given; a directory scanned for the extensions, sorted by
    relative path. A file given twice, or reached twice, is read once."""
    sources, seen, repeated = [], set(), 0
    for given in map(Path, paths):
        if given.is_file():
            found = [given]
        elif given.is_dir():
            found = files_in(given, extensions)
        elif given.exists():  # a pipe, /dev/stdin: the inputs are read twice (tokenizer, shards)
            die(f"input {given} is not a file or a folder -> write it to a file first")
        else:
            die(f"input {given} does not exist -> check the path")
        for path, real in ((path, path.resolve()) for path in found):
            repeated += real in seen
            if real not in seen:
                sources.append((given if given.is_dir() else given.parent, path))
                seen.add(real)
    if repeated:
        say(f"note: {repeated} input files were given twice (or reached by two paths): each is "
            "read once")
    return sources


def files_in(given, extensions):
    """given's files with the extensions, by relative path. Links are followed, each folder once
    (a loop or a second name cannot repeat files); hidden ones (.git, editor backups) are tooling,
    not corpus: left out, with a note."""
    def unreadable(error):
        die(f"cannot read {error.filename}: {error.strerror} -> make it readable, or move it "
            f"out of {given}")

    found, seen, hidden, broken = [], {os.path.realpath(given)}, [], []
    for directory, folders, names in os.walk(given, onerror=unreadable, followlinks=True):
        hidden += [Path(directory, name) for name in folders + names if name.startswith(".")]
        real = [(name, os.path.realpath(os.path.join(directory, name))) for name in folders
                if not name.startswith(".")]
        folders[:] = [name for name, target in real if target not in seen]
        seen.update(target for _, target in real)
        for path in (Path(directory, name) for name in names if not name.startswith(".")):
            if path.suffix.lower() in extensions:
                (found if path.is_file() else broken).append(path)
    left_out = [f"{len(paths)} {what}" for paths, what in [
        (hidden, "hidden (.git, editor backups)"), (broken, "broken links")] if paths]
    if left_out:
        say(f"note: left out of {given}: {', '.join(left_out)}, e.g. "
            f"{', '.join(str(p.relative_to(given)) for p in (broken + hidden)[:3])}")
    if not found:
        die(f"no {','.join(extensions)} files in {given} "
            "-> pass --ext with the extensions your files have")
    return sorted(found, key=lambda p: p.relative_to(given).as_posix())


def iter_documents(sources, field, column, stats):
    """Yield (key, text, text_bytes) of each non-empty document; stats: bytes read, texts replaced.
    The key (path relative to the input root, plus the jsonl line or parquet/arrow row) decides the
    train/val split, so it must not depend on where the corpus lies."""
    for root, path in sources:
        relpath = path.relative_to(root).as_posix()
        if path.suffix.lower() in JSON_LINES_SUFFIXES:
            yield from jsonl_documents(path, relpath, field, stats)
        elif path.suffix.lower() in COLUMNAR_SUFFIXES:
            yield from columnar_documents(path, relpath, column, stats)
        else:
            raw = path.read_bytes()
            stats["input_bytes"] += len(raw)
            try:  # a byte order mark says the encoding (Notepad's "Unicode" is UTF-16); no text
                utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
                text = raw.decode("utf-16" if utf16 else "utf-8-sig")
            except UnicodeDecodeError:
                # a few stdlib files are latin-1 on purpose (tests of source encodings)
                text = raw.decode("utf-8", errors="replace")
                stats["replaced"] += 1
            if text:
                yield relpath, text, len(raw)


def jsonl_documents(path, relpath, field, stats):
    with open(path, "rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            stats["input_bytes"] += len(line)
            if not line.strip():
                continue
            try:
                line = line.decode()
            except UnicodeDecodeError:  # as in text files
                line = line.decode(errors="replace")
                stats["replaced"] += 1
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                die(f"{path}:{line_number} is not a JSON object with a text field {field!r} "
                    "-> fix the line, or pass --field NAME")
            try:
                text_bytes = len(text.encode())
            except UnicodeEncodeError:
                # JSON may escape lone surrogates ("\ud800"), which the tokenizer refuses
                text = text.encode(errors="replace").decode()
                text_bytes = len(text.encode())
                stats["replaced"] += 1
            if text:
                yield f"{relpath}:{line_number}", text, text_bytes


def open_arrow_table(path):
    """Zero-copy table of an .arrow file: IPC file format, or the stream format that Hugging Face
    datasets writes."""
    try:
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def columnar_documents(path, relpath, column, stats):
    try:
        if path.suffix.lower() == ".parquet":
            parquet = pq.ParquetFile(path)
            schema, total_rows = parquet.schema_arrow, parquet.metadata.num_rows
        else:
            table = open_arrow_table(path)
            schema, total_rows = table.schema, table.num_rows
    except (pa.ArrowException, OSError) as error:
        cannot_read_table(path, error)
    if column not in schema.names:
        die(f"{path} has no column {column!r} (it has {', '.join(schema.names)}) "
            "-> pass --column NAME")
    column_type = schema.field(column).type
    if pa.types.is_dictionary(column_type):  # pandas' category: each row reads as its text
        column_type = column_type.value_type
    if str(column_type) not in ("string", "large_string", "string_view"):
        die(f"{path}'s column {column!r} holds {column_type}, not text -> pass --column NAME")
    # record batches: a parquet file larger than memory is fine (an .arrow file is memory-mapped)
    if path.suffix.lower() == ".parquet":
        batches = parquet.iter_batches(batch_size=1024, columns=[column])
    else:
        batches = table.select([column]).to_batches(max_chunksize=1024)
    file_bytes, row_index = path.stat().st_size, 0
    try:
        for batch in batches:
            stats["input_bytes"] += file_bytes * batch.num_rows / max(total_rows, 1)
            for text in batch.column(0).to_pylist():
                if text:
                    yield f"{relpath}:{row_index}", text, len(text.encode())
                row_index += 1
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:  # a damaged page, bad UTF-8
        cannot_read_table(path, error, row_index)


def cannot_read_table(name, error, rows_read=None):
    after = "" if rows_read is None else f" after row {rows_read}"
    reason = (str(error).strip() or type(error).__name__).splitlines()[0]
    die(f"cannot read {name}{after}: {reason} -> check that it is a valid Parquet or Arrow file")


def chunks(documents):
    """Lists of documents bounded by count and bytes: memory stays flat whatever the corpus size."""
    chunk, chunk_bytes = [], 0
    for document in documents:
        chunk.append(document)
        chunk_bytes += document[2]
        if len(chunk) >= CHUNK_DOCUMENTS or chunk_bytes >= CHUNK_BYTES:
            yield chunk
            chunk, chunk_bytes = [], 0
    if chunk:
        yield chunk


def is_val(key, val_fraction):
    """By a hash of the key, not by position: adding or removing files never moves others across
    splits."""
    digest = hashlib.blake2b(key.encode(errors="surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < round(val_fraction * 1_000_000)


def with_progress(label, documents, stats, total_bytes):
    """Pass the documents through; print MB read, %, MB/s and ETA on stderr, every PROGRESS_EVERY_S
    at most: when the next document is asked for, so after the previous chunk is fully processed."""
    start_time = last_print = time.perf_counter()
    for document in documents:
        yield document
        now = time.perf_counter()
        if now - last_print >= PROGRESS_EVERY_S:
            done_bytes, last_print = stats["input_bytes"], now
            speed = done_bytes / 1e6 / (now - start_time)
            say(f"{label}: {done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB  "
                f"{100 * done_bytes / max(total_bytes, 1):.0f}%  {speed:.1f} MB/s  "
                f"ETA {max(total_bytes - done_bytes, 0) / 1e6 / max(speed, 1e-9):.0f} s",
                file=sys.stderr)


# ---- 2. tokenizer --------------------------------------------------------------------------------

def train_tokenizer(documents, vocab_size, length):
    tokenizer = Tokenizer(models.BPE())
    # byte-level: every string round-trips exactly, and no unknown token is ever needed
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=[names[0] for names in SPECIAL_TOKEN_NAMES.values()],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text_batches = ([cut_long_runs(text) for _, text, _ in chunk] for chunk in chunks(documents))
    tokenizer.train_from_iterator(text_batches, trainer=trainer, length=length)
    return tokenizer


def cut_long_runs(text):
    """Long words cut for training alone (encoding takes them whole): BPE training's time grows
    faster than the square of a word's length (200k random letters: 13 s; 2 MB: over 5 min)."""
    if max(map(len, text.split()), default=0) < LONG_RUN:  # faster than the regex on most texts
        return text
    return re.sub(rf"\S{{{LONG_RUN}}}", r"\g<0>\n", text)


def load_tokenizer(path):
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises a bare Exception for a bad file
        die(f"cannot load tokenizer {path}: {error} "
            "-> pass a tokenizer.json saved by the tokenizers library")
    # Often on in pretrained files, for model inputs: here they would cut documents to max_length
    # and put pad ids into the stream. Off in the copy saved with the data too, for the export.
    enabled = [f"truncation to {tokenizer.truncation['max_length']} tokens"
               if tokenizer.truncation else "",
               "padding" if tokenizer.padding else ""]
    if any(enabled):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        say(f"tokenizer {path} has {' and '.join(filter(None, enabled))} enabled: turned off, "
            "so that every document keeps all its tokens and no pad token enters the stream")
    missing = [role for role, names in SPECIAL_TOKEN_NAMES.items()
               if all(tokenizer.token_to_id(name) is None for name in names)]
    if missing:
        tokenizer.add_special_tokens([SPECIAL_TOKEN_NAMES[role][0] for role in missing])
        say(f"tokenizer has no {'/'.join(missing)} token: added "
            f"{', '.join(SPECIAL_TOKEN_NAMES[role][0] for role in missing)} as special tokens")
    return tokenizer


def special_token_ids(tokenizer):
    return {role: next(tokenizer.token_to_id(n) for n in names
                       if tokenizer.token_to_id(n) is not None)
            for role, names in SPECIAL_TOKEN_NAMES.items()}


# ---- 3. tokenize and write shards ----------------------------------------------------------------

class ShardWriter:
    """One split as <split>-00000.arrow, <split>-00001.arrow, ...: a new file before one would pass
    max_size (tokens, or images)."""

    def __init__(self, out_dir, split, schema, max_size):
        self.out_dir, self.split, self.schema, self.max_size = out_dir, split, schema, max_size
        self.files, self.rows, self.size = [], 0, 0
        self.writer, self.size_in_file = None, 0

    def open_next_file(self):
        if self.writer is not None:
            self.writer.close()
        self.files.append(f"{self.split}-{len(self.files):05d}.arrow")
        # the IPC *file* format, not the stream: the trainer memory-maps it and jumps to any batch
        self.writer = pa.ipc.new_file(str(self.out_dir / self.files[-1]), self.schema)
        self.size_in_file = 0

    def write(self, columns, row_sizes):
        start = 0
        while start < len(row_sizes):
            room = self.max_size - self.size_in_file
            fits = int(np.searchsorted(np.cumsum(row_sizes[start:]), room, side="right"))
            if self.writer is None or (fits == 0 and self.size_in_file > 0):
                self.open_next_file()
                continue
            count = max(fits, 1)  # a row larger than a whole shard gets a file of its own
            self.writer.write_batch(pa.record_batch(
                [column.slice(start, count) for column in columns], schema=self.schema))
            self.size_in_file += int(row_sizes[start:start + count].sum())
            start += count
        self.rows += len(row_sizes)
        self.size += int(row_sizes.sum())

    def close(self):
        if self.writer is None:
            # an empty split still gets one zero-row file, so the trainer can say so clearly
            self.open_next_file()
        self.writer.close()


def to_rows(id_lists, eot_id, token_dtype):
    """Arrow list array of (ids + eot) rows from flat values + offsets: no per-token Python code."""
    for ids in id_lists:
        ids.append(eot_id)
    lengths = np.fromiter(map(len, id_lists), np.int64, len(id_lists))
    offsets = np.zeros(len(id_lists) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(id_lists), token_dtype, int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)), lengths, values


def write_shards(documents, tokenizer, out_dir, val_fraction, shard_tokens):
    """Tokenize the documents chunk by chunk into train/val shards; return what meta.json holds."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eot_id = special_token_ids(tokenizer)["eot"]
    token_dtype = np.uint16 if vocab_size <= 65536 else np.int32
    schema = pa.schema([("input_ids", pa.list_(pa.from_numpy_dtype(token_dtype)))])
    writers = {split: ShardWriter(out_dir, split, schema, shard_tokens)
               for split in ("train", "val")}
    token_counts, text_bytes = np.zeros(vocab_size, np.int64), 0
    # encode_batch_fast spreads a batch over all cores and skips the character offsets we never use;
    # tokenizers < 0.21 lacks it
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for chunk in chunks(documents):
        texts = [text for _, text, _ in chunk]
        # no name for the Encoding objects, so they are freed at once: they would set peak memory
        id_lists = [encoding.ids for encoding in encode_batch(texts, add_special_tokens=False)]
        in_val = [is_val(key, val_fraction) for key, _, _ in chunk]
        for split, in_split in (("train", [not v for v in in_val]), ("val", in_val)):
            rows, lengths, values = to_rows(list(itertools.compress(id_lists, in_split)), eot_id,
                                            token_dtype)
            writers[split].write([rows], lengths)
            if split == "train":
                token_counts += np.bincount(values, minlength=vocab_size)
        text_bytes += sum(document_bytes for _, _, document_bytes in chunk)
    for writer in writers.values():
        writer.close()
    return {"vocab_size": vocab_size, "token_dtype": np.dtype(token_dtype).name,
            "text_bytes": text_bytes,
            "splits": {split: {"files": w.files, "documents": w.rows, "tokens": w.size}
                       for split, w in writers.items()},
            "token_counts": token_counts}


# ---- 4. main: options, up-to-date check, build in a temporary directory, rename into place -------

def parse_args():
    parser = argparse.ArgumentParser(
        description="Tokenize a corpus into Arrow shards + meta.json for the trainers. "
                    "Without --input: the Python standard library's *.py files.")
    add = parser.add_argument
    add("--input", nargs="+", metavar="PATH",
        help="text, .jsonl, .parquet, .arrow files or directories")
    add("--out", metavar="DIR", help="output directory (default: data.dir of the config)")
    add("--config", metavar="PATH",
        help="YAML with a data: section (default: config.yaml next to this script)")
    add("--vocab-size", type=int, metavar="N",
        help="BPE vocabulary to train (default: data.vocab_size)")
    add("--val-fraction", type=float, metavar="F",
        help="share of documents held out (data.val_fraction)")
    add("--tokenizer", metavar="PATH",
        help="use this tokenizer.json (or a directory with one), train none")
    add("--ext", metavar="EXTS", default=".txt,.md,.py",
        help="extensions taken from directories (%(default)s)")
    add("--field", metavar="NAME", default="text", help="text field of .jsonl lines (%(default)s)")
    add("--column", metavar="NAME", default="text",
        help="text column of .parquet/.arrow files (%(default)s)")
    add("--shard-tokens", type=int, metavar="N", default=100_000_000,
        help="max tokens per shard (%(default)s)")
    add("--force", action="store_true", help="rebuild even if the output exists")
    add_image_options(add)  # images
    # one line, not the usage text
    parser.error = lambda message: die(f"{message} -> see: preprocess.py --help")
    args = parser.parse_args()
    for name in ["input", "out", "config", "tokenizer", "ext", "field", "column"]:
        value = getattr(args, name)
        if "" in (value if isinstance(value, list) else [value]):
            die(f'--{name} "" is an empty value (an unset shell variable?) -> give one, or leave '
                f"--{name} out")
    check_image_options(parser, args)  # images
    return args


class ConfigLoader(yaml.SafeLoader):
    """YAML as a config means it: 3e-4 a float, 010 and yes strings, a key given twice an error."""

    def construct_mapping(self, node, deep=False):
        seen_at = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":  # << merges
                if key_node.value in seen_at:
                    raise yaml.constructor.ConstructorError(
                        problem=f"'{key_node.value}' is given twice, first at line "
                                f"{seen_at[key_node.value]}", problem_mark=key_node.start_mark)
                seen_at[key_node.value] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers
            if tag.rpartition(":")[2] not in ("bool", "int", "float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for kind, pattern, first_chars in [
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^[-+]?(?:0|[1-9][0-9_]*)$", "-+0123456789"),
        ("float", r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*"
                  r"(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF))$"
                  r"|^\.(?:nan|NaN|NAN)$", "-+0123456789.")]:
    ConfigLoader.add_implicit_resolver(f"tag:yaml.org,2002:{kind}", re.compile(pattern),
                                       first_chars)


def read_data_config(config_arg):
    config_path = Path(config_arg) if config_arg else Path(__file__).parent / "config.yaml"
    if not config_path.exists():
        if config_arg:
            die(f"config {config_path} does not exist -> check the path, or leave --config out")
        return dict(DEFAULTS)
    try:
        tree = yaml.load(config_path.read_text(), Loader=ConfigLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = getattr(error, "problem", None) or error
        die(f"{config_path} is not valid YAML at {where} ({problem}) -> fix that line")
    except OSError as error:
        die(f"cannot read {config_path}: {error} -> fix it: a YAML mapping with a data: section")
    if not isinstance(tree, (dict, type(None))):
        die(f"{config_path} is a {type(tree).__name__}, not a mapping -> fix it: a YAML mapping "
            "with a data: section")
    data = (tree or {}).get("data")
    data = {} if data is None else data
    if not isinstance(data, dict):
        die(f"data: in {config_path} is a {type(data).__name__}, not a mapping "
            "-> write it as data: followed by indented key: value lines")
    values = {}
    for key, default in DEFAULTS.items():
        value = data.get(key, default)
        if isinstance(default, float) and type(value) is int:
            value = float(value)
        if type(value) is not type(default):  # a bool is no int here, and "010" no number
            die(f"data.{key}={value!r} in {config_path} is not a {type(default).__name__} "
                "-> fix it there")
        values[key] = value
    return values


def fingerprint(sources, options):
    """Same fingerprint, same output: it covers the input files (path, size, mtime) and every option
    that changes the output."""
    files = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
             for _, path in sources]
    blob = json.dumps({"format_version": FORMAT_VERSION, "files": files, **options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def output_dir(given):
    """--out as the folder to write: a link's target (a rebuild renames folders, never the link),
    and . or .. by their real names."""
    out = Path(given)
    if out.is_symlink() or out.name in ("", ".", ".."):
        out = Path(os.path.realpath(out))
    if out.is_symlink():  # realpath leaves a loop as it is
        die(f"--out {given} is a link that leads back to itself -> pass the path of a folder")
    return out


def is_up_to_date(out, input_fingerprint, force):
    """True if out holds this very data, complete; dies if it holds other data and --force was not
    given, or anything preprocess.py did not write: a rebuild replaces out whole."""
    if not (out / "meta.json").exists():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            # never delete what we did not write, --force or not (think --out ~)
            die(f"{out} exists and is not preprocess.py output (no meta.json) -> choose another "
                "--out")
        return False
    try:
        meta = json.loads((out / "meta.json").read_text())
        shards = [name for split in meta["splits"].values() for name in split["files"]]
        written = {"meta.json", *shards, *filter(None, [meta.get("tokenizer_file"),
                                                        meta.get("token_frequencies_file")])}
    except (ValueError, OSError, AttributeError, KeyError, TypeError):
        meta, written = {}, {"meta.json"}
    missing = [name for name in sorted(written)
               if not (out / name).is_file() or (out / name).stat().st_size == 0]
    if meta.get("fingerprint") == input_fingerprint and not force and not missing:
        return True
    foreign = sorted(set(os.listdir(out)) - written)
    if foreign:
        die(f"{out} holds {', '.join(map(repr, foreign[:3]))}{' ...' * (len(foreign) > 3)}, which "
            "preprocess.py did not write, and a rebuild would delete them -> move them out of "
            f"{out}, or choose another --out")
    if meta.get("fingerprint") != input_fingerprint and not force:
        die(f"{out} holds data built from other inputs or options "
            "-> pass --force to rebuild, or another --out")
    if missing and not force:
        say(f"note: {out} lacks {missing[0]} (or has it empty): rebuilding it")
    return False


def remove_leftovers(out):
    """Delete the <out>.tmp-preprocess-<pid> (or .old-) a killed run left behind, if that process
    is gone or is this one (pids get reused, the low ones in every new container)."""
    for leftover in [*out.parent.glob(f"{out.name}.tmp-preprocess-*"),
                     *out.parent.glob(f"{out.name}.old-preprocess-*")]:
        pid = leftover.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not is_alive(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


def cannot_build(error, out):
    what = error.strerror or str(error) or type(error).__name__  # shutil's errors have no strerror
    if error.errno == errno.EMFILE:  # each decoding process holds pipes
        return f"{what} -> pass fewer --workers, or raise the open-file limit (ulimit -n)"
    return (f"{what}{f': {error.filename}' if error.filename else ''} -> check that the inputs are "
            f"readable and that {out.parent} is a writable directory with room to spare")


def is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        pass
    return True


def move_into_place(new_dir, out):
    """Renames, never copies: out is at every moment absent, the complete old data, or the complete
    new data."""
    if out.exists():
        old_dir = out.with_name(f"{out.name}.old-preprocess-{os.getpid()}")
        out.rename(old_dir)
        new_dir.rename(out)
        shutil.rmtree(old_dir)
    else:
        new_dir.rename(out)


def main():
    args = parse_args()
    if args.images is not None:  # images
        return build_images(args)  # images
    data_config = read_data_config(args.config)
    out = output_dir(args.out or data_config["dir"])
    vocab_size = args.vocab_size if args.vocab_size is not None else data_config["vocab_size"]
    val_fraction = (args.val_fraction if args.val_fraction is not None
                    else data_config["val_fraction"])
    extensions = sorted({"." + e.strip().lower().lstrip(".")
                         for e in args.ext.split(",") if e.strip()})
    if not 0 <= val_fraction <= 1:
        die(f"val fraction {val_fraction} is not between 0 and 1 -> pass e.g. --val-fraction 0.02")
    if args.shard_tokens < 1:
        die(f"--shard-tokens {args.shard_tokens} is not positive "
            "-> pass e.g. --shard-tokens 100000000")
    if not args.tokenizer and vocab_size < 256 + len(SPECIAL_TOKEN_NAMES):
        die(f"vocab size {vocab_size} is too small: byte-level BPE needs 256 byte tokens "
            f"+ 5 special tokens -> pass --vocab-size {256 + len(SPECIAL_TOKEN_NAMES)} or more")
    if not args.tokenizer and vocab_size > MAX_VOCAB_SIZE:  # the BPE trainer allocates by it
        die(f"vocab size {vocab_size} is above {MAX_VOCAB_SIZE:,} -> pass a smaller --vocab-size")
    if args.input:
        sources = list_sources(args.input, extensions)
        source = f"{', '.join(args.input)}: {len(sources)} files"
    else:
        sources = stdlib_sources()
        source = (f"Python {platform.python_version()} standard library ({sources[0][0]}), *.py, "
                  f"{len(sources)} files")
    tokenizer_file = None
    if args.tokenizer:
        tokenizer_file = Path(args.tokenizer)
        if tokenizer_file.is_dir():
            tokenizer_file = tokenizer_file / "tokenizer.json"
        if not tokenizer_file.is_file():
            die(f"tokenizer {tokenizer_file} does not exist "
                "-> pass a tokenizer.json file or a directory with one")
    tokenizer_hash = (hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
                      if tokenizer_file else None)
    options = {"vocab_size": None if tokenizer_file else vocab_size, "val_fraction": val_fraction,
               "tokenizer_sha256": tokenizer_hash, "ext": extensions, "field": args.field,
               "column": args.column, "shard_tokens": args.shard_tokens}
    input_fingerprint = fingerprint(sources, options)
    if is_up_to_date(out, input_fingerprint, args.force):
        say(f"{out} is up to date (same inputs); --force to rebuild")
        return

    remove_leftovers(out)
    temp_dir = out.with_name(f"{out.name}.tmp-preprocess-{os.getpid()}")
    total_input_bytes = sum(path.stat().st_size for _, path in sources)
    try:
        train_seconds, start_time = 0.0, time.perf_counter()
        if tokenizer_file:
            tokenizer = load_tokenizer(tokenizer_file)
        else:
            say(f"training a {vocab_size}-token byte-level BPE tokenizer on the train split "
                f"of {source}")
            # train split only: measure the validation loss on text the tokenizer has never seen
            stats = Counter()
            documents = with_progress("tokenizer training",
                                      iter_documents(sources, args.field, args.column, stats),
                                      stats, total_input_bytes)
            train_documents = (document for document in documents
                               if not is_val(document[0], val_fraction))
            all_text_files = all(p.suffix.lower() not in (*JSON_LINES_SUFFIXES, *COLUMNAR_SUFFIXES)
                                 for _, p in sources)
            tokenizer = train_tokenizer(train_documents, vocab_size,
                                        len(sources) if all_text_files else None)
            train_seconds = time.perf_counter() - start_time
            say(f"trained the tokenizer in {train_seconds:.1f} s")
            trained_size = tokenizer.get_vocab_size(with_added_tokens=True)
            if trained_size < vocab_size:
                # BPE stops when no pair of tokens is left to merge in the corpus
                say(f"note: the tokenizer has {trained_size:,} tokens, not the {vocab_size:,} "
                    "asked for: every word of the train split is one token already "
                    "(a larger vocabulary needs more text, or --tokenizer)")
        temp_dir.mkdir(parents=True)
        tokenizer.save(str(temp_dir / "tokenizer.json"))
        # a document that merely contains the text "<|endoftext|>" must not get a real separator id;
        # tokenizer.json does not store this flag: the export's tokenizer maps that text to the id
        tokenizer.encode_special_tokens = True

        stats, start_time = Counter(), time.perf_counter()
        documents = with_progress("tokenize",
                                  iter_documents(sources, args.field, args.column, stats),
                                  stats, total_input_bytes)
        result = write_shards(documents, tokenizer, temp_dir, val_fraction, args.shard_tokens)
        seconds = time.perf_counter() - start_time
        if result["splits"]["train"]["documents"] == 0:  # a trainer could not take one step
            die(f"no text for the train split in {source} (empty files, or --val-fraction "
                f"{val_fraction} holds out everything) -> pass files with text, "
                "or a --val-fraction below 1")
        # how often each token id occurs in the train split, for the trainer's
        # model.embedding_gpu_rows: a file, since a JSON list of 500k numbers would bury meta.json
        np.save(temp_dir / "token_frequencies.npy", result["token_counts"])
        meta = {"format_version": FORMAT_VERSION, "tokenizer_file": "tokenizer.json",
                "vocab_size": result["vocab_size"], "special_tokens": special_token_ids(tokenizer),
                "token_dtype": result["token_dtype"], "eot_appended": True,
                "splits": result["splits"], "source": source, "fingerprint": input_fingerprint,
                "tokenizer_trained": tokenizer_file is None,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "bytes": result["text_bytes"], "token_frequencies_file": "token_frequencies.npy"}
        # last: its presence means complete
        (temp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        move_into_place(temp_dir, out)
    except OSError as error:  # an unreadable input, --out below a file, a full disk: keep nothing
        die(cannot_build(error, out))
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # after a failure; after success it is gone

    splits, megabytes = result["splits"], result["text_bytes"] / 1e6
    say(f"{out}: {splits['train']['documents']} train / {splits['val']['documents']} val "
        f"documents, {splits['train']['tokens'] + splits['val']['tokens']:,} tokens, "
        f"{megabytes:.1f} MB in {seconds:.1f} s ({megabytes / max(seconds, 1e-9):.1f} MB/s); "
        + (f"tokenizer from {tokenizer_file}" if tokenizer_file
           else f"tokenizer training {train_seconds:.1f} s")
        + (f"; invalid UTF-8 replaced by U+FFFD in {stats['replaced']} documents"
           if stats["replaced"] else ""))
    val = splits["val"]
    if val["documents"] == 0:
        say(f"warning: the val split is empty (--val-fraction {val_fraction}): no text to "
            "measure a validation loss on -> "
            + ("pass e.g. --val-fraction 0.02 to hold out 2% of the documents" if not val_fraction
               else "give more documents, or raise --val-fraction"), file=sys.stderr)
    elif val["documents"] < TINY_VAL_DOCUMENTS or val["tokens"] < TINY_VAL_TOKENS:
        say(f"warning: the val split is tiny, {val['documents']} documents and {val['tokens']:,} "
            f"tokens (fewer than {TINY_VAL_DOCUMENTS} documents or {TINY_VAL_TOKENS:,} tokens), "
            f"so its loss says little -> raise --val-fraction (now {val_fraction}) or give more "
            "text", file=sys.stderr)


# ============================================================================== images: begin
# Images for classification, from an image folder (one sub-folder per class), Hugging Face Parquet
# or Arrow files, or without a source scikit-learn's handwritten digits. Read build_images() first.
# Delete this block and the lines tagged # images: the text path stays.

# names of files that are no image, never opened (of these, Pillow's stubs would claim
# .mpg/.mpeg videos and .h5/.hdf files, and decode none)
NOT_IMAGE_SUFFIXES = {".txt", ".md", ".json", ".jsonl", ".csv", ".tsv", ".xml", ".yaml", ".yml",
                      ".html", ".pdf", ".py", ".ipynb", ".log", ".ini", ".db", ".zip", ".tar",
                      ".gz", ".7z", ".npy", ".npz", ".pt", ".pth", ".pkl", ".mat", ".h5", ".hdf",
                      ".parquet", ".arrow", ".mp4", ".mov", ".avi", ".mpg", ".mpeg", ".mp3", ".wav"}
IMAGE_DEFAULTS = {"image_size": 224, "val_fraction": 0.1, "workers": None}
# one worker: 1,797 tiny images decode in less time than a pool takes to start
DIGITS_DEFAULTS = {"out": "data/digits", "image_size": 32, "val_fraction": 0.2, "workers": 1}
# the pixels of one row must fit the 32-bit width of Arrow's fixed-size binary
MAX_IMAGE_SIZE = 26_754
SHARD_IMAGES, SHARD_BYTES = 4096, 256_000_000
# the version of to_rgb's rules, in the fingerprint: output of older rules needs --force
PIXEL_CONVERSION = 2
# how a file or folder name says its split (HF: train-00000-of-00001.parquet, validation/...)
SPLIT_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val",
               "validation": "val", "test": "test", "testing": "test"}


def add_image_options(add):
    # --images alone is True, the digits: --images "" (an unset shell variable) is a mistake
    add("--images", nargs="?", const=True, metavar="SOURCE",
        help="images instead of text: a folder of class sub-folders, Parquet/Arrow files in "
             "Hugging Face's layout, or nothing for scikit-learn's digits (into data/digits)")
    add("--image-size", type=int, metavar="N",
        help=f"shorter side resized to N, then the centre N x N kept "
             f"({IMAGE_DEFAULTS['image_size']}; digits {DIGITS_DEFAULTS['image_size']})")
    add("--workers", type=int, metavar="K", help="decoding processes (all cores; digits 1)")


def check_image_options(parser, args):
    """Text options with --images, or image options without it: a mistake, said in one line."""
    if args.images is None:
        names, fix = ["image_size", "workers"], "add --images SOURCE, or leave it out"
    else:
        names = ["input", "config", "vocab_size", "tokenizer", "ext", "field", "column",
                 "shard_tokens"]
        fix = "leave it out: it is an option of the text path"
    given = [name for name in names if getattr(args, name) != parser.get_default(name)]
    if given:
        option = "--" + given[0].replace("_", "-")
        die(f"{option} does not go {'without' if args.images is None else 'with'} --images "
            f"-> {fix}")


def build_images(args):
    """main() for images: options, the source, the up-to-date check, the shards and meta.json in a
    temporary directory, renamed into place."""
    try:
        import PIL  # noqa: F401  (here, so that the text path runs without it)
    except ImportError:
        die("Pillow is not installed -> pip install Pillow")
    if args.images == "":
        die('--images "" is an empty path (an unset shell variable?) -> pass a folder or file, or '
            "--images with nothing after it for scikit-learn's digits")
    digits = args.images is True
    defaults = DIGITS_DEFAULTS if digits else IMAGE_DEFAULTS
    size = args.image_size if args.image_size is not None else defaults["image_size"]
    val_fraction = (args.val_fraction if args.val_fraction is not None
                    else defaults["val_fraction"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = next(k for k in (args.workers, defaults["workers"], cpus) if k is not None)
    if not 4 <= size <= MAX_IMAGE_SIZE:
        die(f"--image-size {size} is not between 4 and {MAX_IMAGE_SIZE} (a ViT needs 4 x 4 patches "
            "of at least one pixel) -> pass e.g. --image-size 224")
    if workers < 1:
        die(f"--workers {workers} is not positive -> pass e.g. --workers {cpus}, or leave it out")
    if not 0 <= val_fraction <= 1:
        die(f"val fraction {val_fraction} is not between 0 and 1 -> pass e.g. --val-fraction 0.1")
    if not digits and not args.out:
        given = Path(args.images).resolve()  # resolved, --images . has a name
        suggestion = Path("data", (given.stem if given.is_file() else given.name) or "images")
        if Path.cwd().resolve().is_relative_to(given):  # from inside the images: beside them
            suggestion = Path(os.path.relpath(given.parent / suggestion))
        die(f"--images {args.images} needs --out -> pass e.g. --out {suggestion}")
    out = output_dir(args.out or DIGITS_DEFAULTS["out"])
    if not digits and out.resolve().is_relative_to(Path(args.images).resolve()):
        die(f"--out {out} lies inside --images {args.images}, where a rerun would read it as "
            "images -> pass an --out outside it")
    source = digits_source() if digits else path_source(Path(args.images))
    if len(source["classes"]) < 2:  # a classifier with one class learns nothing
        die(f"{source['description']}: one class only ({source['classes'][0]}) -> give it two or "
            "more classes: a sub-folder, or a label, for each")
    if source["split_given"] and args.val_fraction is not None:
        say(f"note: the source gives the split ({source['split_given']}): --val-fraction unused")
    options = {"kind": "images", "image_size": size, "conversion": PIXEL_CONVERSION,
               "val_fraction": None if source["split_given"] else val_fraction}
    blob = json.dumps({"format_version": FORMAT_VERSION, "identity": source["identity"],
                       **options}, sort_keys=True)
    input_fingerprint = hashlib.sha256(blob.encode()).hexdigest()
    if is_up_to_date(out, input_fingerprint, args.force):
        say(f"{shown(out)} is up to date (same inputs); --force to rebuild")
        return

    remove_leftovers(out)
    temp_dir = out.with_name(f"{out.name}.tmp-preprocess-{os.getpid()}")
    try:
        start_time = time.perf_counter()
        temp_dir.mkdir(parents=True)
        result = write_image_shards(source, temp_dir, size, val_fraction, workers,
                                    upsample=digits)
        seconds = time.perf_counter() - start_time
        meta = {"format_version": FORMAT_VERSION, "kind": "images", "image_size": size,
                "channels": 3, "classes": source["classes"], "mean": result["mean"],
                "std": result["std"], "splits": result["splits"], "skipped": result["skipped"],
                "source": source["description"], "fingerprint": input_fingerprint}
        # last: its presence means complete
        (temp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        move_into_place(temp_dir, out)
    except OSError as error:  # --out below a file, a full disk: keep nothing
        die(cannot_build(error, out))
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # after a failure; after success it is gone

    splits = result["splits"]
    images = splits["train"]["images"] + splits["val"]["images"]
    say(f"{shown(out)}: {splits['train']['images']:,} train / {splits['val']['images']:,} val "
        f"images of {size}x{size}, {len(source['classes'])} classes, in {seconds:.1f} s "
        f"({images / max(seconds, 1e-9):.0f} images/s, {workers} worker{'s' * (workers > 1)})")
    if splits["val"]["images"] == 0:
        say("warning: the val split is empty: no images to measure a validation accuracy on -> "
            + ("add images to the source's val split" if source["split_given"]
               else f"raise --val-fraction (now {val_fraction})"
               + (", e.g. to 0.1" if val_fraction < 0.1 else ", or give it more images")),
            file=sys.stderr)


# ---- images: the sources, each a dict whose items are (key, label, split or None, what to decode)
# (to_split: the (key, label) of items without a split; tried, passed_over: for the note of skips)

def path_source(given):
    if given.is_file():
        if given.suffix.lower() not in COLUMNAR_SUFFIXES:
            die(f"{given} is not a folder, .parquet or .arrow file -> pass a folder with one "
                "sub-folder of images per class, or Parquet/Arrow files (unpack archives first)")
        return table_source(given.parent, [given.name])
    if not given.is_dir():
        die(f"input {given} does not exist -> check the path")
    trees, note = split_folders(given)
    found, passed_over = files_under(given, trees)
    suffixes = [os.path.splitext(relpath)[1].lower() for relpath, _, _ in found]
    tables = [relpath for (relpath, _, _), suffix in zip(found, suffixes)
              if suffix in COLUMNAR_SUFFIXES]
    image_names = image_suffixes(suffixes)
    if tables and not image_names:
        return table_source(given, sorted(tables))
    if all(suffix in NOT_IMAGE_SUFFIXES for suffix in suffixes):
        die(f"no images and no Parquet/Arrow files in {shown(given)} -> pass a folder with one "
            "sub-folder of images per class, or Hugging Face Parquet files")
    return folder_source(given, trees, found, passed_over, note, image_names)


def image_suffixes(suffixes):
    """Those of these names that Pillow opens (.jpg, .png, .jfif, .avif, .ppm, ...)."""
    suffixes = set(suffixes) - NOT_IMAGE_SUFFIXES
    # the usual names need no answer from Pillow: importing its plugins takes longer than
    # listing a few thousand files
    if suffixes <= {".jpg", ".jpeg", ".png"}:
        return suffixes
    from PIL import Image
    formats = Image.registered_extensions()  # also of formats Pillow only writes (.pdf)
    return {suffix for suffix in suffixes if formats.get(suffix) in Image.OPEN}


def is_hidden(name):
    return name.startswith(".") or name == "__MACOSX"  # where macOS's zips keep ._ files


def shown(text):
    """A name for print and meta.json: a byte that is not UTF-8 (a zip made on Windows) as \\xe9."""
    return os.fsencode(text).decode(errors="backslashreplace")


def shell_word(path):
    """path in bash's $'...' quotes, each byte that is not printable ASCII as \\xe9: bash reads
    back the very bytes."""
    return "$'" + "".join(chr(byte) if 32 <= byte < 127 and byte not in b"'\\"
                          else f"\\x{byte:02x}" for byte in os.fsencode(path)) + "'"


def split_word(relpath):
    """The split a file or folder name says, by its last word that is one (data/train-0.parquet)."""
    import re
    words = re.split(r"[^a-z]+", relpath.lower())
    return next((SPLIT_WORDS[word] for word in reversed(words) if word in SPLIT_WORDS), None)


def split_folders(root):
    """The trees that hold the class folders, each with its split: train/ and a validation folder
    (val/, valid/, validation/, else test/), train/ alone (then a hash splits it), or root itself;
    and the note that says which folders became which split."""
    folders = sorted(entry.name for entry in os.scandir(root)
                     if entry.is_dir() and not is_hidden(entry.name))
    # a split folder holds class folders; a class folder named train (CIFAR-100's) holds images
    words = {name: split_word(name) for name in folders
             if split_word(name) and holds_folders(root / name)}
    if not words:
        if len(folders) > 1 and all(split_word(name) for name in folders):
            die(f"the folders in {shown(root)} ({', '.join(map(shown, folders))}) are named as "
                "splits, not classes -> put each class's images in a folder of its own: "
                f"{shown(root / folders[0] / 'CLASS' / 'IMAGE.jpg')}")
        return {"": None}, None
    named = {split: [name for name in words if words[name] == split]
             for split in ("train", "val", "test")}
    if not named["train"]:
        first = next(iter(words))
        die(f"{shown(root / first)} holds folders and is named as a {words[first]} split, but "
            f"{shown(root)} has no train folder beside it -> put the training images in "
            f"{shown(root / 'train' / 'CLASS')}/, or pass a folder of class folders")
    if len(named["train"]) > 1:
        die(f"{' and '.join(map(shown, named['train']))} in {shown(root)} are both named as the "
            "train split -> keep one, or move the other out")
    train, val = named["train"][0], (named["val"] or named["test"] or [None])[0]
    trees = {f"{train}/": "train", f"{val}/": "val"} if val else {f"{train}/": None}
    left_out = [f"{shown(name)}/" for name in folders if name not in (train, val)]
    given = (f"{shown(train)}/ -> train, {shown(val)}/ -> val" if val
             else f"{shown(train)}/ -> train and val (by a hash of each path)")
    return trees, (f"note: splits from folders: {given}"
                   + (f"; {', '.join(left_out)} left out" if left_out else ""))


def holds_folders(path):
    with os.scandir(path) as entries:
        return any(entry.is_dir() for entry in entries)


def files_under(root, trees):
    """The files in root's trees as (relpath, os.stat_result or None for a broken link, whether a
    link led to it), and what was passed over as (kind, relpath). Links are followed (a dataset is
    often a tree of links), but real folders before the links found in them, those before the links
    found behind them, and each folder once: a loop or a second name cannot repeat its files."""
    found, passed_over, read = [], [], set()
    pending = [(tree, os.path.join(root, tree), False) for tree in trees]
    while pending:
        relative, path, linked = pending.pop(0)
        folders = [(relative, path, os.path.realpath(path))]
        while folders:
            relative, path, real = folders.pop()
            if real in read:
                passed_over.append(("second path", relative))
                continue
            read.add(real)
            try:
                entries = sorted(os.scandir(path), key=lambda entry: entry.name)
            except OSError as error:
                die(f"cannot read {shown(path)}: {error.strerror} -> make it readable, or move it "
                    f"out of {shown(root)}")
            for entry in entries:
                relpath = relative + entry.name
                if is_hidden(entry.name):
                    passed_over.append(("hidden", relpath + "/" * entry.is_dir()))
                elif not entry.is_dir():
                    try:
                        stat = entry.stat()
                    except OSError:  # a broken link: it fails to decode, and is counted
                        stat = None
                    found.append((relpath, stat, linked or entry.is_symlink()))
                elif not entry.is_symlink():
                    folders.append((relpath + "/", entry.path, os.path.join(real, entry.name)))
                else:
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([real, target]) == target:  # a folder above: a loop
                        passed_over.append(("second path", relpath + "/"))
                    else:
                        pending.append((relpath + "/", entry.path, True))
    return found, passed_over


def note_similar_names(names, what):
    """A note on names that differ only in case or in how an accent is encoded: distinct classes
    that a reader, and a Windows or macOS disk, may take for one."""
    import unicodedata
    folded = Counter(unicodedata.normalize("NFC", name).casefold() for name in names)
    similar = [name for name in names
               if folded[unicodedata.normalize("NFC", name).casefold()] > 1]
    if similar:
        say(f"note: {what} {', '.join(map(shown, similar))} differ only in case (or in how an "
            "accent is encoded): they are distinct classes")


def class_folders(class_root):
    """The names of the class folders, sorted; each must be text, as meta.json holds them."""
    import shlex
    classes = sorted(entry.name for entry in os.scandir(class_root)
                     if entry.is_dir() and not is_hidden(entry.name))
    if not classes:
        die(f"{shown(class_root)} has no class sub-folders -> put each class's images in a folder "
            f"named after it: {shown(class_root / 'CLASS' / 'IMAGE.jpg')}")
    for name in classes:
        try:
            name.encode()
        except UnicodeEncodeError:
            path = class_root / name
            guess = class_root / os.fsencode(name).decode("cp1252", errors="replace")
            die(f"class folder {shown(path)} has a name that is not UTF-8 (a zip made on "
                f"Windows?), so it cannot name a class -> rename it, e.g. mv {shell_word(path)} "
                f"{shlex.quote(str(guess))}")
    return classes


def folder_source(root, trees, found, passed_over, note, image_names):
    """An image folder: class = the sub-folder (of the train tree, if there is one), sorted by name;
    a file Pillow may read whatever its name, each file once: of two paths to it (links) the first,
    a real one before a link. The split is the tree's, else a hash of each path."""
    import shlex
    first_tree = next(iter(trees))
    class_root = root / first_tree
    classes = class_folders(class_root)
    label_of = {name: label for label, name in enumerate(classes)}
    items, tried, counts, readers = [], set(), Counter(), {}
    for relpath, stat, _ in sorted(found, key=lambda file: (file[2], file[0])):
        tree = next(tree for tree in trees if relpath.startswith(tree))
        parts = relpath[len(tree):].split("/")
        suffix = os.path.splitext(relpath)[1].lower()
        if len(parts) < 2:  # a loose file beside the class folders
            passed_over.append(("outside the class folders", relpath))
            continue
        if suffix in NOT_IMAGE_SUFFIXES:
            passed_over.append(("not an image", relpath))
            continue
        if parts[0] not in label_of:
            die(f"{shown(root / tree / parts[0])} is no class of {shown(class_root)} -> give every "
                f"class a folder in {shown(class_root)}, or move this one out")
        identity = (stat.st_dev, stat.st_ino) if stat else relpath
        if identity in readers:  # a link to a file read already, or a hard link
            passed_over.append(("second path", relpath))
            continue
        readers[identity] = relpath
        if suffix not in image_names:  # Pillow may still read it (no extension, .jpg_large)
            tried.add(relpath)
        items.append((relpath, label_of[parts[0]], trees[tree], str(root / relpath), stat))
        counts[parts[0]] += tree == first_tree
    items.sort()
    empty = [name for name in classes if not counts[name]]
    if empty:
        folder = class_root / empty[0]
        is_link = ("second path", f"{folder.relative_to(root).as_posix()}/") in passed_over
        die(f"class folder {shown(folder)} "
            + ("is a link to a folder read already, as another class or within one"
               if is_link else "holds no images")
            + (f", nor do {len(empty) - 1} more" if len(empty) > 1 else "")
            + (" -> remove the link, or make the folder a copy" if is_link
               else " -> add images to it, or remove it"))
    if len(classes) == 1 and all(relpath[len(first_tree):].count("/") > 1  # a folder too high
                                 for relpath, *_ in items if relpath.startswith(first_tree)):
        die(f"{shown(class_root)} holds one class folder, {shown(classes[0])}, and its images lie "
            "in sub-folders -> pass --images " + shlex.quote(shown(class_root / classes[0])))
    note_similar_names(classes, "class folders")
    if note:
        say(note)
    # the files' sizes and times: a changed image makes a rebuild, as in the text path
    digest = hashlib.sha256(os.fsencode(root.resolve()))
    for relpath, _, _, _, stat in items:
        digest.update(os.fsencode(relpath) + (f"\0{stat.st_size}\0{stat.st_mtime_ns}\n" if stat
                                              else "\0unreadable\n").encode())
    return {"classes": classes, "items": [item[:4] for item in items], "total": len(items),
            "split_given": " and ".join(trees) if len(trees) == 2 else None,
            "identity": digest.hexdigest(), "tried": tried, "passed_over": passed_over,
            "to_split": [(key, label) for key, label, split, *_ in items if split is None],
            "description": f"{shown(root)}: image folder, {len(items):,} images in "
                           f"{len(classes)} classes"}


def table_source(root, relpaths):
    """Parquet or Arrow files as Hugging Face datasets writes them: an image column of {bytes, path}
    structs (or plain bytes), a label column of class ids or names. File names give the split."""
    import pyarrow.compute as pc
    tables = []
    for relpath in relpaths:
        path = root / relpath
        try:
            if path.suffix.lower() == ".parquet":
                schema = pq.ParquetFile(path).schema_arrow
            else:
                schema = open_arrow_table(path).schema
        except (pa.ArrowException, OSError) as error:
            cannot_read_table(shown(path), error)
        tables.append((path, relpath, schema))
    path, _, schema = tables[0]
    image_column = find_image_column(schema)
    label_column = next((name for name in ("label", "labels") if name in schema.names), None)
    if image_column is None:
        die(f"{path} has no image column (a struct of bytes and path, or binary; it has "
            f"{', '.join(schema.names)}) -> store the encoded images in a column named image")
    if label_column is None:
        die(f"{path} has no label column 'label' or 'labels' (it has {', '.join(schema.names)}) "
            "-> rename the column of class ids or names to label")
    label_type = schema.field(label_column).type
    if not (pa.types.is_integer(label_type) or pa.types.is_string(label_type)
            or pa.types.is_large_string(label_type)):
        die(f"label column {label_column!r} of {path} is {label_type}, not integers or strings "
            "-> store class ids (int) or class names (string) in it")
    for path, _, other in tables[1:]:
        if image_column not in other.names or label_column not in other.names or \
                other.field(image_column).type != schema.field(image_column).type or \
                other.field(label_column).type != label_type:
            die(f"{path} has other columns than {tables[0][0]} -> pass files of one dataset")

    # HF's own file names: validation (else test) is the val split, if there is one
    words = [split_word(relpath) for _, relpath, _ in tables]
    val_word = "val" if "val" in words else "test" if "test" in words else None
    used = [(path, relpath, ("val" if word == val_word else "train") if val_word else None)
            for (path, relpath, _), word in zip(tables, words)
            if word not in ("val", "test") or word == val_word]
    columns = [read_column(path, label_column) for path, _, _ in used]
    labels = pa.chunked_array(columns, label_type)
    if len(labels) == 0:
        die(f"the files in {root} have no rows -> pass files that hold images")
    if labels.null_count:
        die(f"{labels.null_count:,} rows have no label in {root} -> drop them first")
    if pa.types.is_integer(label_type):
        lowest, highest = pc.min(labels).as_py(), pc.max(labels).as_py()
        names = class_names(schema, label_column)
        if lowest < 0:
            die(f"{pc.sum(pc.less(labels, 0)).as_py():,} rows in {root} have a negative label, "
                f"e.g. {lowest} (HF's mark of no label) -> drop them, or pass only labelled splits")
        if any(class_names(other, label_column) != names for _, _, other in tables[1:]):
            die(f"the files in {root} name the classes differently in their metadata "
                "-> pass the files of one version of one dataset")
        if names is None:  # no names: the ids that occur are the classes, named by their ids
            ids = sorted(pc.unique(labels).to_pylist())
            classes, label_of = [str(i) for i in ids], {i: label for label, i in enumerate(ids)}
            if ids != list(range(len(ids))):
                say(f"note: the labels in {root} have no names, and not all of 0 to {highest} "
                    f"occur: the {len(ids)} that do are the classes, named by their ids")
        elif highest >= len(names):
            die(f"label {highest} in {root} has no name among the {len(names)} class names in "
                "the files' metadata -> fix the names or the labels")
        else:
            classes, label_of = names, {label: label for label in range(len(names))}
    else:
        classes = sorted(pc.unique(labels).to_pylist())
        label_of = {name: label for label, name in enumerate(classes)}
        note_similar_names(classes, "labels")
    counts = np.bincount([label_of[label] for label in labels.to_pylist()],
                         minlength=len(classes))
    if not counts.all():
        die(f"class {classes[int(np.argmin(counts))]!r} has no images in {root} "
            f"({int((counts == 0).sum())} such classes) -> drop it from the class names")
    if val_word:
        unnamed = [shown(relpath) for (_, relpath, _), word in zip(tables, words) if word is None]
        say("note: splits from file names: " + ", ".join(
            (["train files -> train"] if "train" in words else []) + [f"{val_word} files -> val"]
            + ([f"{len(unnamed)} with no split in the name ({', '.join(unnamed[:3])}) -> train"]
               if unnamed else []))
            + ("; test files left out" if val_word == "val" and "test" in words else ""))
    identity = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
                for path, _, _ in used]
    suffixes = "/".join(sorted({path.suffix for path, _, _ in used}))
    to_split = [] if val_word else [
        (f"{relpath}:{row}", label_of[label]) for (_, relpath, _), column in zip(used, columns)
        for row, label in enumerate(column.to_pylist())]
    return {"classes": classes, "items": table_items(used, image_column, label_column, label_of),
            "total": len(labels), "split_given": "file names" if val_word else None,
            "identity": identity, "tried": set(), "passed_over": [], "to_split": to_split,
            "description": f"{shown(root)}: {len(used)} {suffixes} files, {len(labels):,} images "
                           f"in {len(classes)} classes"}


def find_image_column(schema):
    """By type, a struct with bytes (HF's Image feature), else binary; of several, image or img
    (a segmentation set's mask is an Image too), else none."""
    structs = [field.name for field in schema
               if pa.types.is_struct(field.type) and field.type.get_field_index("bytes") >= 0]
    binary = [field.name for field in schema if pa.types.is_binary(field.type)
              or pa.types.is_large_binary(field.type)]
    for names in (structs, binary):
        if names:
            named = [name for name in ("image", "img") if name in names]
            return named[0] if named else names[0] if len(names) == 1 else None
    return None


def class_names(schema, label_column):
    """The names HF datasets keeps for a ClassLabel column in the schema's metadata, or None."""
    try:
        features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
        return [str(name) for name in features[label_column]["names"]]
    except (KeyError, TypeError, ValueError):
        return None


def read_column(path, name):
    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_table(path, columns=[name]).column(0).combine_chunks()
        return open_arrow_table(path).column(name).combine_chunks()
    except (pa.ArrowException, OSError) as error:  # a damaged page
        cannot_read_table(shown(path), error)


def table_items(used, image_column, label_column, label_of):
    """Rows in record batches: a Parquet file larger than memory is fine."""
    for path, relpath, split in used:
        if path.suffix.lower() == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=256,
                                                        columns=[image_column, label_column])
        else:
            batches = open_arrow_table(path).select([image_column, label_column]).to_batches(256)
        row_index = 0
        try:
            for batch in batches:
                for image, label in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                    data = image.get("bytes") if isinstance(image, dict) else image
                    if data is None and isinstance(image, dict) and image.get("path"):
                        data = str(path.parent / image["path"])  # not embedded: the file it names
                    yield f"{relpath}:{row_index}", label_of[label], split, data
                    row_index += 1
        except (pa.ArrowException, OSError) as error:  # a damaged page
            cannot_read_table(shown(path), error, row_index)


def digits_source():
    """scikit-learn's 1,797 digits: the file load_digits() reads, read without importing
    scikit-learn, which (with SciPy) takes longer than the whole build."""
    import importlib.metadata
    import importlib.util
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        die("scikit-learn is not installed (--images without a path means its bundled digits) "
            "-> pip install scikit-learn, or pass --images PATH")
    version = importlib.metadata.version("scikit-learn")
    csv = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if csv.is_file():
        table = np.loadtxt(csv, delimiter=",")  # 64 pixels, then the digit, a row per image
        images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    else:  # another scikit-learn keeps it elsewhere
        from sklearn.datasets import load_digits
        digits = load_digits()
        images, target = digits.images, digits.target
    pixels = np.round(images * (255 / 16)).astype(np.uint8)  # 17 ink levels, 0..16
    items = [(f"digits:{index}", int(label), None, image)
             for index, (image, label) in enumerate(zip(pixels, target))]
    return {"classes": [str(digit) for digit in range(10)], "items": items, "total": len(items),
            "split_given": None, "identity": f"scikit-learn {version} load_digits",
            "tried": set(), "passed_over": [], "to_split": [item[:2] for item in items],
            "description": f"scikit-learn {version} load_digits: {len(items):,} 8x8 grayscale "
                           "scans of handwritten digits, upsampled"}


# ---- images: decode in a process pool, write shards ----------------------------------------------

def decode_image(task):
    """(pixels, channel sums, channel sums of squares, shorter side, its mode if to_rgb scaled it,
    whether it has NaN or infinite pixels) of one image, as the trainer reads them: RGB, the shorter
    side resized to size (bicubic), the centre size x size; or the reason it does not decode."""
    import io
    import warnings
    from PIL import Image
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # large, and resized anyway
    data, size = task
    if data is None:
        return "no image data"
    try:
        if isinstance(data, np.ndarray):
            image = Image.fromarray(data)
        else:
            image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        with image:
            image.load()
            scaled_mode = image.mode if image.mode in WIDE_MODES else None
            has_non_finite = image.mode == "F" and not np.isfinite(np.asarray(image)).all()
            rgb = to_rgb(image)
    except Image.UnidentifiedImageError:
        return "not an image Pillow reads"
    except Image.DecompressionBombError:
        return f"more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels, Pillow's limit (against bombs)"
    except Exception as error:  # Pillow raises many kinds for a bad file
        return f"{type(error).__name__}: {error}"
    width, height = rgb.size
    new_size = (size, size * height // width) if width <= height else \
        (size * width // height, size)
    resized = rgb.resize(new_size, Image.Resampling.BICUBIC)
    left, top = (new_size[0] - size) // 2, (new_size[1] - size) // 2  # as transformers' crop
    pixels = np.asarray(resized.crop((left, top, left + size, top + size)))
    # from histograms: exact integers, and many times faster than sums over the pixel axis
    counts = np.stack([np.bincount(pixels[..., channel].ravel(), minlength=256)
                       for channel in range(3)])
    levels = np.arange(256, dtype=np.int64)
    return (pixels.tobytes(), counts @ levels, counts @ (levels * levels), min(width, height),
            scaled_mode, has_non_finite)


# 16- and 32-bit grey, integer or float: Pillow's convert("RGB") clips their values to 0..255
WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def to_rgb(image):
    """An image as transformers' load_image hands it to the exported pipeline: turned upright by
    its EXIF orientation, then Pillow's convert("RGB"), which drops alpha and ignores a CMYK ICC
    profile. WIDE_MODES, which that would clip, are first scaled from the image's own minimum and
    maximum to 0..255 (of its finite pixels: NaN and inf become 0): pass the pipeline
    to_rgb(Image.open(path)) for those."""
    import warnings
    from PIL import Image, ImageOps
    image = ImageOps.exif_transpose(image)
    if image.mode in WIDE_MODES:
        values = np.asarray(image, dtype=np.float64)
        finite = np.isfinite(values)  # a NaN or inf (mode F) would make every scaled pixel NaN
        if not finite.any():
            raise ValueError("every pixel is NaN or infinite")
        low, high = values[finite].min(), values[finite].max()
        values = np.where(finite, values, low)
        scaled = (values - low) * (255 / (high - low) if high > low else 0)
        image = Image.fromarray(np.round(scaled).astype(np.uint8))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Palette images with Transparency")
        # alpha dropped, not put on white: the pipeline's load_image drops it too
        return image.convert("RGB")


# chunks the workers decode while this process writes one: with a single one they idle at each
# chunk's end, until this process hands them the next
CHUNKS_IN_FLIGHT = 3


def decoded_chunks(items, size, workers):
    """(items, decode_image results) chunk by chunk, in order; with a pool, the next chunks decode
    while this one is written, and at most CHUNKS_IN_FLIGHT + 1 are in memory."""
    import multiprocessing
    import signal
    chunk_images = max(256, 16 * workers)
    chunks_of_items = iter(lambda: list(itertools.islice(items, chunk_images)), [])
    if workers == 1:
        for chunk in chunks_of_items:
            yield chunk, [decode_image((data, size)) for _, _, _, data in chunk]
        return
    # spawn, not fork: threads run here already (pyarrow's allocator, numpy's BLAS), and a fork
    # would copy their locks in whatever state they are
    context = multiprocessing.get_context("spawn")
    # Ctrl-C goes to the whole process group: the workers leave it to this process
    with context.Pool(workers, initializer=signal.signal,
                      initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        pending = []
        for chunk in chunks_of_items:
            tasks = [(data, size) for _, _, _, data in chunk]
            pending.append((chunk, pool.map_async(decode_image, tasks,
                                                  chunksize=max(1, len(tasks) // (4 * workers)))))
            if len(pending) > CHUNKS_IN_FLIGHT:
                done, results = pending.pop(0)
                yield done, results.get()
        for done, results in pending:
            yield done, results.get()


def first_keys_held_out(keys_and_labels, val_fraction):
    """The first key of each class that is_val() would hold out whole."""
    first, trained = {}, set()
    for key, label in keys_and_labels:
        first.setdefault(label, key)
        if not is_val(key, val_fraction):
            trained.add(label)
    return {key for label, key in first.items() if label not in trained}


def write_image_shards(source, out_dir, size, val_fraction, workers, upsample=False):
    """Decode the source's images into train/val shards; return what meta.json holds of them.
    Images smaller than size are an error, unless upsample (the 8x8 digits)."""
    row_bytes = size * size * 3
    schema = pa.schema([("pixels", pa.binary(row_bytes)), ("label", pa.int32())])
    rows_per_shard = max(1, min(SHARD_IMAGES, SHARD_BYTES // row_bytes))
    writers = {split: ShardWriter(out_dir, split, schema, rows_per_shard)
               for split in ("train", "val")}
    sums, squares = np.zeros(3, np.int64), np.zeros(3, np.int64)
    skipped, small, small_count, smallest, done = [], [], 0, size, 0
    scaled = Counter()  # images of WIDE_MODES, by mode
    non_finite = []  # images with NaN or infinite pixels
    passed_over, tried_and_failed, train_counts = list(source["passed_over"]), 0, Counter()
    # a class the hash would hold out whole trains on its first image: else no model could learn it
    to_train = first_keys_held_out(source["to_split"], val_fraction) if val_fraction < 1 else ()
    start_time = last_print = time.perf_counter()
    for chunk, results in decoded_chunks(iter(source["items"]), size, workers):
        rows = {"train": ([], []), "val": ([], [])}
        for (key, label, split, _), result in zip(chunk, results):
            if isinstance(result, str):
                if key in source["tried"]:  # its name never said it was an image
                    passed_over.append(("not an image", key))
                    tried_and_failed += 1
                else:
                    skipped.append((key, result))
                continue
            (pixels, channel_sums, channel_squares, shorter_side, scaled_mode,
             has_non_finite) = result
            if scaled_mode:
                scaled[scaled_mode] += 1
            if has_non_finite:
                non_finite.append(key)
            if split is None:
                split = "val" if key not in to_train and is_val(key, val_fraction) else "train"
            rows[split][0].append(pixels)
            rows[split][1].append(label)
            if shorter_side < size:
                small_count, smallest = small_count + 1, min(smallest, shorter_side)
                if len(small) < 3:
                    small.append(f"{shown(key)} ({shorter_side} px)")
            if split == "train":
                sums += channel_sums
                squares += channel_squares
                train_counts[label] += 1
        for split, (pixels, labels) in rows.items():
            if labels:
                writers[split].write([pa.array(pixels, pa.binary(row_bytes)),
                                      pa.array(labels, pa.int32())], np.ones(len(labels), int))
        done += len(chunk)
        now = time.perf_counter()
        if now - last_print >= PROGRESS_EVERY_S:
            last_print, speed = now, done / (now - start_time)
            say(f"decode: {done:,}/{source['total']:,} images  "
                f"{100 * done / source['total']:.0f}%  {speed:.0f} images/s  "
                f"ETA {(source['total'] - done) / speed:.0f} s", file=sys.stderr)
    for writer in writers.values():
        writer.close()

    train_images = writers["train"].rows
    images = done - tried_and_failed
    if train_images == 0:  # a trainer could not take one step
        reason = (f"no image of it decodes (first {shown(skipped[0][0])}: {skipped[0][1]})"
                  if skipped else "no file of it is an image Pillow reads" if not images
                  else f"--val-fraction {val_fraction} holds out everything")
        die(f"no images for the train split: {reason} -> pass images that Pillow reads, "
            "or a --val-fraction below 1")
    named = (", ".join(f"{shown(key)} ({reason})" for key, reason in skipped[:3])
             + (", ..." if len(skipped) > 3 else ""))
    if 100 * len(skipped) > images:  # not a few bad files: a broken download, or the wrong files
        die(f"{len(skipped):,} of {images:,} files ({100 * len(skipped) / images:.3g}%) do not "
            f"decode, more than the 1% that is skipped: {named} -> repair or remove them")
    if small_count and not upsample:  # upsampled, they would be blurrier than the rest
        die(f"{small_count:,} of {images - len(skipped):,} images are smaller than --image-size "
            f"{size} on their shorter side: {', '.join(small)}"
            + (", ..." if small_count > 3 else "")
            + (f" -> pass --image-size {smallest}, or remove them" if smallest >= 4 else
               " -> remove them (a ViT needs 4 pixels or more a side)"))
    print_skipped(skipped, named, images, passed_over)
    if scaled.total():
        modes = ", ".join(f"{count:,} {mode}" for mode, count in sorted(scaled.items()))
        say(f"note: scaled {scaled.total():,} images of 16- or 32-bit modes ({modes}) to 8 bits, "
            "each from its own minimum..maximum to 0..255; the exported pipeline would clip them "
            "(Pillow's convert) -> pass it preprocess.to_rgb(Image.open(path)), not the path")
    if non_finite:
        say(f"note: {len(non_finite):,} images had NaN or infinite pixels ("
            + ", ".join(shown(key) for key in non_finite[:3]) + ", ..." * (len(non_finite) > 3)
            + "): each scaled by the range of its finite pixels, and those pixels set to 0")
    untrained = [name for label, name in enumerate(source["classes"]) if not train_counts[label]]
    if untrained:
        say(f"warning: {len(untrained)} of {len(source['classes'])} classes have no image in "
            f"the train split, so the model cannot learn them: {', '.join(untrained[:5])}"
            + (", ..." if len(untrained) > 5 else "")
            + " -> give each some training images, or remove them", file=sys.stderr)
    pixel_count = train_images * size * size
    mean = sums / (pixel_count * 255)
    std = np.sqrt(np.maximum(squares / (pixel_count * 255 ** 2) - mean ** 2, 0))
    return {"mean": mean.tolist(), "std": std.tolist(),
            "splits": {split: {"files": w.files, "images": w.rows} for split, w in writers.items()},
            "skipped": {"count": len(skipped),
                        "examples": [shown(key) for key, _ in skipped[:5]]}}


def print_skipped(skipped, named, images, passed_over):
    """One note for every file not read: the images that do not decode, then the rest by kind."""
    parts = [f"{len(skipped):,} of {images:,} files that do not decode: {named}"] if skipped else []
    for kind, heading in (("not an image", "not images"), ("hidden", "hidden files or folders"),
                          ("outside the class folders", "outside the class folders"),
                          ("second path", "second paths (links) to what was read already")):
        names = [relpath for other, relpath in passed_over if other == kind]
        if kind == "not an image":  # by kind: 2 .txt, 1 .svg
            suffixes = Counter(os.path.splitext(name)[1].lower() or "no extension"
                               for name in names)
            examples = [f"{count} {suffix}" for suffix, count in sorted(suffixes.items())]
        else:
            examples = [shown(name) for name in names[:3]] + ["..."] * (len(names) > 3)
        if names:
            parts.append(f"{heading}: {len(names):,} ({', '.join(examples)})")
    if parts:
        say("note: skipped " + "; ".join(parts))


# ============================================================================== images: end


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the temporary folder is gone (finally); out is as it was
        say("stopped by Ctrl-C: nothing was written", file=sys.stderr)
        sys.exit(130)
