#!/bin/bash
# The wheels the GPU image lacks, for device_run.sh (`carry=[".whl"]`), fetched here (PyPI) for its CPython
# 3.12 on x86_64: Ling2's config and data stack (pydantic, grain and what they need beyond the image's
# packages, /work/.library/device/KINDS.md) and fla-core, the kernels' reference. Versions are this repo's
# locks'. Run from the repository root; .whl stays out of git.
set -eu
cd "$(dirname "$0")/../../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir .whl
PLATFORMS=""
for n in 1 2014 2_17 2_24 2_27 2_28 2_31; do PLATFORMS="$PLATFORMS --platform manylinux${n/#2_/_2_}_x86_64"; done
for pkg in fla-core==0.6.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
           grain==0.2.18 array-record==0.8.6 portpicker==1.6.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .whl "$pkg"
done
ls .whl
