"""``giantmodel preprocess`` and ``giantmodel tokenizer``: argument parsing and thin runners."""

from __future__ import annotations

import argparse
import os
import sys

from giantmodel.config.errors import UserInputError
from giantmodel.data.preprocess import expand_inputs, iter_records, preprocess
from giantmodel.data.tokenizer import load_tokenizer, train_sentencepiece


def add_preprocess_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Tokenize jsonl, text, parquet or a saved Hugging Face dataset into a "
                     "Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx). Each document "
                     "ends with the tokenizer's EOS.")
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="files, directories or globs; a directory saved with "
                        "datasets.save_to_disk is read as one HF dataset")
    p.add_argument("--output-prefix", "-o", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", "-t", required=True, metavar="PATH",
                   help="SentencePiece .model, HF tokenizer.json, or a directory with one")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "parquet", "hf"],
                   help="input format (auto: by extension; .jsonl/.json, .parquet, HF dataset "
                        "directory, anything else is text)")
    p.add_argument("--json-key", default="text",
                   help="field (jsonl) or column (parquet, HF) holding the text (default: text)")
    p.add_argument("--text-unit", default="paragraph", choices=["paragraph", "line", "file"],
                   help="what one document is in plain-text input (default: paragraph, i.e. "
                        "blank-line separated)")
    p.add_argument("--split", default="train", help="split of a saved HF DatasetDict (default: train)")
    p.add_argument("--workers", "-j", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizer processes (default: CPU count, at most 8)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run_preprocess(args: argparse.Namespace) -> int:

    stats = preprocess(args.input, args.output_prefix, args.tokenizer, fmt=args.format,
                       json_key=args.json_key, text_unit=args.text_unit, hf_split=args.split,
                       workers=args.workers, progress=not args.quiet)
    note = f", skipped {stats.skipped} records without text" if stats.skipped else ""
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents:,} documents, "
          f"{stats.tokens:,} tokens in {stats.seconds:.1f}s "
          f"({stats.tokens_per_sec:,.0f} tokens/s){note}")
    return 0


def add_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Train or inspect tokenizers."
    sub = p.add_subparsers(dest="tokenizer_command", metavar="{train,encode}")
    sub.required = True
    t = sub.add_parser("train", help="train a SentencePiece model on text files",
                       description="Train a SentencePiece model; writes PREFIX.model.")
    t.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="text files, directories or globs; jsonl/parquet/HF inputs are read "
                        "like `giantmodel preprocess` reads them")
    t.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    t.add_argument("--out", "-o", required=True, metavar="PREFIX", help="writes PREFIX.model")
    t.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    t.add_argument("--json-key", default="text", help="text field for jsonl/parquet/HF input")
    t.add_argument("--plain", action="store_true",
                   help="SentencePiece's default normalisation (NFKC, folded whitespace) "
                        "instead of exact, code-friendly text")
    e = sub.add_parser("encode", help="print the token ids of a text",
                       description="Encode TEXT and print ids and the decoded round trip.")
    e.add_argument("--tokenizer", "-t", required=True, metavar="PATH")
    e.add_argument("text")


def _training_lines(inputs: list[str], json_key: str):
    import json


    for kind, payload in iter_records(expand_inputs(inputs), json_key=json_key,
                                      text_unit="file", hf_split="train"):
        if kind == "json":
            try:
                payload = json.loads(payload).get(json_key)
            except (ValueError, AttributeError):
                continue
            if not isinstance(payload, str):
                continue
        yield from payload.split("\n")


def run_tokenizer(args: argparse.Namespace) -> int:

    if args.tokenizer_command == "train":
        if args.vocab_size < 2:
            raise UserInputError(f"--vocab-size must be positive, got {args.vocab_size}")
        out = train_sentencepiece(_training_lines(args.input, args.json_key), args.out,
                                  args.vocab_size, model_type=args.model_type,
                                  code_friendly=not args.plain)
        tok = load_tokenizer(out)
        print(f"wrote {out}: {tok.vocab_size} pieces, eos_id={tok.eos_id}, bos_id={tok.bos_id}")
        return 0
    if args.tokenizer_command == "encode":
        tok = load_tokenizer(args.tokenizer)
        ids = tok.encode(args.text)
        print(" ".join(map(str, ids)))
        print(repr(tok.decode(ids)), file=sys.stderr)
        return 0
    raise UserInputError(f"unknown tokenizer command {args.tokenizer_command!r}")
