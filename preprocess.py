"""Turn text into the token shards the trainers memory-map: byte-level BPE, Arrow files, meta.json.

Run it (no arguments: this Python's own standard library, some 30 MB of *.py, into data.dir of
config.yaml):
    python preprocess.py
    python preprocess.py --input my_texts/ more.jsonl --out data/mine     # your own corpus

Read `main()` at the bottom first, then `write_shards()`, which makes the layout the trainers rely
on: train-00000.arrow, ..., val-00000.arrow are Arrow IPC files with one row per document in one
column `input_ids`; a row holds the document's token ids FOLLOWED BY the end-of-text id, so the
column's flat values buffer is already the causal-LM token stream with separators. meta.json says
how it was all made; token_frequencies.npy holds how often each token id occurs in the train split
(int64, one per id).
"""
import argparse
import hashlib
import itertools
import json
import os
import platform
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
# per encode batch: bounds memory whatever the corpus size
CHUNK_DOCUMENTS, CHUNK_BYTES = 10_000, 4_000_000
PROGRESS_EVERY_S = 2.0
# A val split below either gets a warning: its loss would rest on a handful of texts.
TINY_VAL_DOCUMENTS, TINY_VAL_TOKENS = 20, 10_000


def die(message):
    """For every foreseeable mistake: what is wrong -> how to fix it, one stderr line, exit 2."""
    print("error: " + str(message).replace("\n", " "), file=sys.stderr)
    sys.exit(2)


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
    relative path."""
    sources = []
    for given in map(Path, paths):
        if given.is_file():
            sources.append((given.parent, given))
        elif given.is_dir():
            # hidden parts (.git, editor backups) are tooling, not corpus
            found = [p for p in given.rglob("*")
                     if p.suffix.lower() in extensions and p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(given).parts)]
            if not found:
                die(f"no {','.join(extensions)} files in {given} "
                    "-> pass --ext with the extensions your files have")
            sources += [(given, p)
                        for p in sorted(found, key=lambda p: p.relative_to(given).as_posix())]
        else:
            die(f"input {given} does not exist -> check the path")
    return sources


def iter_documents(sources, field, column, stats):
    """Yield (key, text, text_bytes) of each non-empty document; stats: bytes read, texts replaced.
    The key (path relative to the input root, plus the jsonl line or parquet/arrow row) decides the
    train/val split, so it must not depend on where the corpus lies."""
    for root, path in sources:
        relpath = path.relative_to(root).as_posix()
        if path.suffix.lower() == ".jsonl":
            yield from jsonl_documents(path, relpath, field, stats)
        elif path.suffix.lower() in COLUMNAR_SUFFIXES:
            yield from columnar_documents(path, relpath, column, stats)
        else:
            raw = path.read_bytes()
            stats["input_bytes"] += len(raw)
            try:
                text = raw.decode("utf-8")
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
        die(f"cannot read {path}: {error} -> check that it is a valid Parquet or Arrow file")
    column_type = schema.field(column).type if column in schema.names else pa.null()
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        die(f"{path} has no text column {column!r} (it has {', '.join(schema.names)}) "
            "-> pass --column NAME")
    # record batches: a parquet file larger than memory is fine (an .arrow file is memory-mapped)
    if path.suffix.lower() == ".parquet":
        batches = parquet.iter_batches(batch_size=1024, columns=[column])
    else:
        batches = table.select([column]).to_batches(max_chunksize=1024)
    file_bytes, row_index = path.stat().st_size, 0
    for batch in batches:
        stats["input_bytes"] += file_bytes * batch.num_rows / max(total_rows, 1)
        for text in batch.column(0).to_pylist():
            if text:
                yield f"{relpath}:{row_index}", text, len(text.encode())
            row_index += 1


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
            print(f"{label}: {done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB  "
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
    text_batches = ([text for _, text, _ in chunk] for chunk in chunks(documents))
    tokenizer.train_from_iterator(text_batches, trainer=trainer, length=length)
    return tokenizer


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
        print(f"tokenizer {path} has {' and '.join(filter(None, enabled))} enabled: turned off, "
              "so that every document keeps all its tokens and no pad token enters the stream")
    missing = [role for role, names in SPECIAL_TOKEN_NAMES.items()
               if all(tokenizer.token_to_id(name) is None for name in names)]
    if missing:
        tokenizer.add_special_tokens([SPECIAL_TOKEN_NAMES[role][0] for role in missing])
        print(f"tokenizer has no {'/'.join(missing)} token: added "
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
    # one line, not the usage text
    parser.error = lambda message: die(f"{message} -> see: preprocess.py --help")
    return parser.parse_args()


def read_data_config(config_arg):
    config_path = Path(config_arg) if config_arg else Path(__file__).parent / "config.yaml"
    if not config_path.exists():
        if config_arg:
            die(f"config {config_path} does not exist -> check the path, or leave --config out")
        return dict(DEFAULTS)
    try:
        data = (yaml.safe_load(config_path.read_text()) or {}).get("data") or {}
    except (yaml.YAMLError, OSError, AttributeError) as error:
        die(f"cannot read {config_path}: {error} -> fix it: a YAML mapping with a data: section")
    if not isinstance(data, dict):
        die(f"data: in {config_path} is a {type(data).__name__}, not a mapping "
            "-> write it as data: followed by indented key: value lines")
    values = {}
    for key, default in DEFAULTS.items():
        value = data.get(key, default)
        try:  # float("2e-2"): plain YAML reads an exponent without a dot as a string
            # str([1]) would make a directory named "[1]"
            if isinstance(value, (list, dict)) or value is None:
                raise TypeError
            values[key] = type(default)(value)
        except (TypeError, ValueError):
            die(f"data.{key}={value!r} in {config_path} is not a {type(default).__name__} "
                "-> fix it there")
    return values


def fingerprint(sources, options):
    """Same fingerprint, same output: it covers the input files (path, size, mtime) and every option
    that changes the output."""
    files = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
             for _, path in sources]
    blob = json.dumps({"format_version": FORMAT_VERSION, "files": files, **options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def is_up_to_date(out, input_fingerprint, force):
    """True if out holds this very data; dies if it holds other data and --force was not given."""
    if (out / "meta.json").exists():
        try:
            old_fingerprint = json.loads((out / "meta.json").read_text()).get("fingerprint")
        except (ValueError, OSError, AttributeError):
            old_fingerprint = None
        if old_fingerprint == input_fingerprint and not force:
            return True
        if not force:
            die(f"{out} holds data built from other inputs or options "
                "-> pass --force to rebuild, or another --out")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        # never delete what we did not write, --force or not (think --out ~)
        die(f"{out} exists and is not preprocess.py output (no meta.json) -> choose another --out")
    return False


def remove_leftovers(out):
    """Delete the <out>.tmp-<pid> (or .old-<pid>) a killed run left behind, if that process is gone
    or is this one (pids get reused, the low ones in every new container)."""
    for leftover in [*out.parent.glob(f"{out.name}.tmp-*"), *out.parent.glob(f"{out.name}.old-*")]:
        pid = leftover.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not is_alive(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


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
        old_dir = out.with_name(f"{out.name}.old-{os.getpid()}")
        out.rename(old_dir)
        new_dir.rename(out)
        shutil.rmtree(old_dir)
    else:
        new_dir.rename(out)


def main():
    args = parse_args()
    data_config = read_data_config(args.config)
    out = Path(args.out or data_config["dir"])
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
        print(f"{out} is up to date (same inputs); --force to rebuild")
        return

    remove_leftovers(out)
    temp_dir = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    total_input_bytes = sum(path.stat().st_size for _, path in sources)
    try:
        train_seconds, start_time = 0.0, time.perf_counter()
        if tokenizer_file:
            tokenizer = load_tokenizer(tokenizer_file)
        else:
            print(f"training a {vocab_size}-token byte-level BPE tokenizer on the train split "
                  f"of {source}")
            # train split only: measure the validation loss on text the tokenizer has never seen
            stats = Counter()
            documents = with_progress("tokenizer training",
                                      iter_documents(sources, args.field, args.column, stats),
                                      stats, total_input_bytes)
            train_documents = (document for document in documents
                               if not is_val(document[0], val_fraction))
            all_text_files = all(p.suffix.lower() not in (".jsonl", *COLUMNAR_SUFFIXES)
                                 for _, p in sources)
            tokenizer = train_tokenizer(train_documents, vocab_size,
                                        len(sources) if all_text_files else None)
            train_seconds = time.perf_counter() - start_time
            print(f"trained the tokenizer in {train_seconds:.1f} s")
            trained_size = tokenizer.get_vocab_size(with_added_tokens=True)
            if trained_size < vocab_size:
                # BPE stops when no pair of tokens is left to merge in the corpus
                print(f"note: the tokenizer has {trained_size:,} tokens, not the {vocab_size:,} "
                      "asked for: every word of the train split is one token already "
                      "(a larger vocabulary needs more text, or --tokenizer)")
        temp_dir.mkdir(parents=True)
        tokenizer.save(str(temp_dir / "tokenizer.json"))
        # only now, so the saved file keeps the usual behaviour: a document that merely contains the
        # text "<|endoftext|>" must not get a real separator id in the middle of it
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
        die(f"{error.strerror}: {error.filename} -> check that the inputs are readable and that "
            f"{out.parent} is a writable directory with room to spare")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # after a failure; after success it is gone

    splits, megabytes = result["splits"], result["text_bytes"] / 1e6
    print(f"{out}: {splits['train']['documents']} train / {splits['val']['documents']} val "
          f"documents, {splits['train']['tokens'] + splits['val']['tokens']:,} tokens, "
          f"{megabytes:.1f} MB in {seconds:.1f} s ({megabytes / max(seconds, 1e-9):.1f} MB/s); "
          + (f"tokenizer from {tokenizer_file}" if tokenizer_file
             else f"tokenizer training {train_seconds:.1f} s")
          + (f"; invalid UTF-8 replaced by U+FFFD in {stats['replaced']} documents"
             if stats["replaced"] else ""))
    val = splits["val"]
    if val["documents"] == 0:
        print(f"warning: the val split is empty (--val-fraction {val_fraction}): no text to "
              "measure a validation loss on -> pass e.g. --val-fraction 0.02 to hold out 2% of the "
              "documents", file=sys.stderr)
    elif val["documents"] < TINY_VAL_DOCUMENTS or val["tokens"] < TINY_VAL_TOKENS:
        print(f"warning: the val split is tiny, {val['documents']} documents and {val['tokens']:,} "
              f"tokens (fewer than {TINY_VAL_DOCUMENTS} documents or {TINY_VAL_TOKENS:,} tokens), "
              f"so its loss says little -> raise --val-fraction (now {val_fraction}) or give more "
              "text", file=sys.stderr)


if __name__ == "__main__":
    main()
