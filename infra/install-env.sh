#!/usr/bin/env bash
# Install exactly the packages pinned in LOCK into the virtualenv DIR (made if missing), with uv
# (pinned; installed from PyPI into .venv-uv) or, when uv cannot be installed or INSTALLER=pip, with
# pip. Both install the lock's packages and nothing else (no dependency resolution), plus pip;
# --editable then installs this project (with setuptools, its build backend). Usage: infra/install-env.sh DIR LOCK [--editable]
set -euo pipefail
dir=$1 lock=$2 editable=${3:-}
UV_VERSION=0.13.8
PIP_VERSION=26.3
SETUPTOOLS_VERSION=84.2.1
python=${PYTHON:-python3}
uv=.venv-uv/bin/uv

test -x "$dir/bin/python" || "$python" -m venv "$dir"
if [ "${INSTALLER:-uv}" = uv ] && ! "$uv" --version 2>/dev/null | grep -qx "uv $UV_VERSION"; then
    rm -rf .venv-uv
    # --isolated: uv comes from PyPI; the extra indexes of a pip.conf would each print a warning.
    "$python" -m venv .venv-uv && .venv-uv/bin/pip install --isolated --disable-pip-version-check -q "uv==$UV_VERSION" || rm -rf .venv-uv
fi

if [ "${INSTALLER:-uv}" = uv ] && [ -x "$uv" ]; then
    # uv reads neither pip.conf nor PIP_FIND_LINKS: pass pip's find-links on (the local CPU torch wheel).
    links=()
    for l in ${PIP_FIND_LINKS:-} $("$python" -m pip config get global.find-links 2>/dev/null || true); do
        links+=(--find-links "$l")
    done
    # sync: exactly the lock (packages it does not list are removed), nothing resolved.
    "$uv" pip sync -q --python "$dir/bin/python" "${links[@]}" "$lock"
    "$uv" pip install -q --no-deps --python "$dir/bin/python" "pip==$PIP_VERSION"
    if [ "$editable" = --editable ]; then
        "$uv" pip install -q --no-deps --python "$dir/bin/python" "setuptools==$SETUPTOOLS_VERSION"
        "$uv" pip install -q --no-deps --python "$dir/bin/python" -e .
    fi
else
    [ "${INSTALLER:-uv}" = pip ] || echo "setup: uv $UV_VERSION could not be installed from PyPI; installing with pip (slower)" >&2
    "$dir/bin/pip" install -q --upgrade "pip==$PIP_VERSION"
    "$dir/bin/pip" install -q --no-deps -r "$lock"
    if [ "$editable" = --editable ]; then
        "$dir/bin/pip" install -q --upgrade "setuptools==$SETUPTOOLS_VERSION"
        "$dir/bin/pip" install -q --no-deps --no-build-isolation -e .
    fi
fi
