#!/usr/bin/env bash
# Downloads into .whl/ (repo root, git-ignored) the wheels that the GPU machine's image lacks
# for flair 0.15.1 on CPython 3.12, manylinux x86_64. Run it where PyPI is reachable and carry .whl/ with the working
# tree to the GPU machine (no network there); there `make gpu-check` (python3 benchmarks/gpu_check.py
# --install-wheels) installs them with `pip install --no-index --no-deps --target /tmp/site` and puts /tmp/site first
# on the path.
#
# The image (/work/.library/device/KINDS.md) has torch 2.11, lightning 2.6.6, transformers 5.17.0, tokenizers
# 0.23.2, huggingface_hub 1.33.0, numpy, scipy, scikit-learn, matplotlib, lxml, regex, tqdm, requests, pyyaml,
# tabulate, python-dateutil, wrapt, safetensors, sentencepiece, ... but not flair. The list below is flair 0.15.1's
# Requires-Dist minus what the image has, plus what those packages need when `import flair` (with flair.datasets,
# flair.embeddings, flair.models, flair.trainers) runs:
#
#   flair pins transformers[sentencepiece]<5.0.0,>=4.25.0, so transformers 4.57.6 (the last 4.x) travels too, with
#   the tokenizers (>=0.22,<=0.23.0) and huggingface-hub (>=0.34,<1.0) it checks for when it is imported; installed
#   in /tmp/site they shadow the image's 5.x versions.
#   module-level imports of flair: boto3 + botocore, s3transfer, jmespath (file_utils); deprecated (data, models);
#   segtok (tokenization); ftfy + wcwidth, conllu, gdown + beautifulsoup4, soupsieve, PySocks, bioc (flair.datasets);
#   transformer-smaller-training-vocab (flair.trainers.plugins).
#   imported only inside functions, small wheels: more-itertools, mpld3, pytorch-revgrad, wikipedia-api (+ tenacity).
#   left out: langdetect, sqlitedict and pptree (no wheels on PyPI; imported only inside functions or by
#   flair.visual, which nothing here imports), bioc's docopt/jsonlines/intervaltree (not imported by `bioc.biocxml`,
#   `bioc.pubtator`), transformer-smaller-training-vocab's `datasets` (imported only when the vocabulary is reduced).
#
#   PYTHON=python3 benchmarks/gpu_wheels.sh      # prints the wheels and their total size (must stay under ~60 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST=.whl

WHEELS=(
    flair==0.15.1
    transformers==4.57.6
    tokenizers==0.22.2
    huggingface-hub==0.36.2
    boto3==1.44.8
    botocore==1.44.8
    s3transfer==0.19.3
    jmespath==1.1.0
    deprecated==1.3.1
    segtok==1.5.11
    ftfy==6.3.1
    wcwidth==0.9.4
    conllu==4.5.3
    gdown==6.5.1
    beautifulsoup4==4.15.0
    soupsieve==4.1.3
    pysocks==1.7.1
    bioc==2.1
    transformer-smaller-training-vocab==0.4.2
    more-itertools==11.2.1
    mpld3==0.5.12
    pytorch-revgrad==0.2.0
    wikipedia-api==0.16.0
    tenacity==9.1.4
)

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "${WHEELS[@]}"

# one version of each package (two stop the whole install there): drop wheels left from older lists
normal() { tr '[:upper:]' '[:lower:]' | tr -- '-.' '__'; }
wanted=$(for pin in "${WHEELS[@]}"; do echo "$(normal <<<"${pin%%==*}")-${pin##*==}"; done)
for wheel in "$DEST"/*.whl; do
    file=$(basename "$wheel")
    key="$(cut -d- -f1 <<<"$file" | normal)-$(cut -d- -f2 <<<"$file")"
    if ! grep -qxF "$key" <<<"$wanted"; then
        echo "removing $wheel (not in the list)" >&2
        rm -f "$wheel"
    fi
done

count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
ls -l "$DEST"/*.whl | awk '{printf "%9.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
awk -v t="$total" -v n="$count" 'BEGIN { printf "%d wheels, %.1f MiB in all\n", n, t / 1048576 }'
if [ "$total" -gt $((60 * 1048576)) ]; then
    echo "the wheels exceed 60 MiB: they would not travel with the working tree (64 MiB per call)" >&2
    exit 1
fi
