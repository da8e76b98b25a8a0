#!/usr/bin/env bash
# Build isolate-test:debian12-isolate, the image tests/test_containers.py runs
# isolate in: Debian 12 (the root file system that ../shared/vm/build.sh makes)
# with this checkout installed in /opt/venv, a user alice and /work owned by
# her. Nothing is pulled. Idempotent for a given commit; prints one line and
# exits 0 when it cannot build (the tests then skip and say why).
set -uo pipefail
cd "$(dirname "$0")/.."
IMAGE=isolate-test:debian12-isolate
CACHE="${ISOLATE_VM_CACHE:-/var/cache/isolate-vm}"
say() { echo "container_image: $*"; }
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$(docker image inspect -f '{{index .Config.Labels "isolate.commit"}}' "$IMAGE" 2>/dev/null)" = "$commit" ]; then
    say "ready: $IMAGE ($commit)"; exit 0
fi
[ -f "$CACHE/rootfs.img" ] && [ -d "$CACHE/wheels" ] || { say "no $CACHE/rootfs.img (run ../shared/vm/build.sh)"; exit 0; }
work="$(mktemp -d)"; trap 'umount "$work/root" 2>/dev/null; rm -rf "$work"' EXIT
mkdir "$work/root" "$work/src"
mount -o loop,ro "$CACHE/rootfs.img" "$work/root" || { say "cannot mount $CACHE/rootfs.img"; exit 0; }
tar -C "$work/root" --exclude=./boot --exclude=./usr/lib/modules -c . | docker import - isolate-test:debian12 >/dev/null ||
    { say "docker import failed"; exit 0; }
git ls-files -z | xargs -0 cp --parents -t "$work/src"
docker rm -f isolate-image-build >/dev/null 2>&1
docker run --name isolate-image-build -v "$work/src:/src:ro" -v "$CACHE/wheels:/wheels:ro" isolate-test:debian12 sh -c '
    cp -r /src /opt/isolate-src && python3 -m venv /opt/venv &&
    /opt/venv/bin/pip install -q --no-index --find-links /wheels /opt/isolate-src &&
    ln -s /opt/venv/bin/isolate-run /usr/local/bin/isolate-run && useradd -m alice && mkdir /work && chown alice /work' \
    >"$work/build.log" 2>&1 || { tail -n 20 "$work/build.log"; say "installing isolate in the image failed"; exit 0; }
docker commit -c "LABEL isolate.commit=$commit" isolate-image-build "$IMAGE" >/dev/null
docker rm isolate-image-build >/dev/null
say "ready: $IMAGE ($commit)"
