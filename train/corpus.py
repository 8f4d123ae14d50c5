"""The default model's English corpus, assembled offline from Debian packages (the recipe; the corpus
itself is not kept in the repository).

    python train/corpus.py OUT_DIR        # downloads the .debs with apt-get, writes OUT_DIR/corpus.txt

Sources: dict-gcide (the GNU Collaborative International Dictionary of English, markup stripped),
python3.11-doc (the reST sources of the Python documentation) and linux-doc-6.1 (the kernel's
reST documentation). Each document becomes one paragraph-preserving text block separated by a
blank line; blocks are shuffled with a fixed seed so a held-out tail mixes all three sources.
"""

from __future__ import annotations

import gzip
import random
import re
import subprocess
import sys
from pathlib import Path

PACKAGES = ("dict-gcide", "python3.11-doc", "linux-doc-6.1")


def download(work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=work, check=True)
    root = work / "x"
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def gcide_entries(root: Path):
    raw = gzip.open(root / "usr/share/dictd/gcide.dict.dz", "rt", encoding="utf-8", errors="replace").read()
    for entry in raw.split("\n\n"):
        text = re.sub(r"<[^>]*>", "", entry)
        text = re.sub(r"[ \t]+", " ", text).strip()
        if len(text) > 40:
            yield text


def rst_text(text: str) -> str:
    text = re.sub(r"^\.\. [^\n]*\n(?:[ \t]+[^\n]*\n)*", "", text, flags=re.M)  # directives and comments
    text = re.sub(r"^[=\-~^*#+`'\"]{3,}\s*$", "", text, flags=re.M)  # heading underlines
    text = re.sub(r":[a-z:]+:`([^`]*)`", r"\1", text)  # roles
    text = text.replace("``", "")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def docs(root: Path):
    for f in sorted((root / "usr/share/doc/python3.11-doc/html/_sources").rglob("*.txt")):
        yield rst_text(f.read_text(errors="replace"))
    for f in sorted((root / "usr/share/doc/linux-doc-6.1/Documentation").rglob("*.rst.gz")):
        yield rst_text(gzip.open(f, "rt", errors="replace").read())


def main(out: Path) -> None:
    root = download(out / "debs")
    blocks = list(gcide_entries(root)) + [d for d in docs(root) if len(d) > 200]
    random.Random(0).shuffle(blocks)
    text = "\n\n".join(blocks)
    text = "".join(ch for ch in text if ch == "\n" or 32 <= ord(ch) < 127 or ch.isalpha())
    (out / "corpus.txt").write_text(text)
    print(f"{len(blocks)} documents, {len(text) / 1e6:.1f} MB -> {out / 'corpus.txt'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
