#!/bin/sh
# Pin every image of deploy/kubernetes by digest: writes images/kustomization.yaml, the component the base
# requires (docs/fleet.md, "Images").
#
#   deploy/kubernetes/pin-images.sh REGISTRY/trm:TAG      # the trm image you built and pushed
#
# Each image named in base/deployment.yaml is resolved from its tag to the digest its registry serves now,
# with crane, skopeo or docker buildx (the first one installed); the trm image is renamed to the one given.
# Rerun it to move to a new Triton or trm release; review the diff of what it printed before applying.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
placeholder=registry.example.com/trm          # the trm image's name in base/deployment.yaml
if [ $# -ne 1 ] || [ "${1%:*}" = "$1" ] || [ "${1#*@}" != "$1" ]; then
    echo "usage: $0 REGISTRY/trm:TAG (the trm image you pushed, by tag: its digest is read here)" >&2
    exit 2
fi
trm=$1

digest() {
    if command -v crane >/dev/null 2>&1; then
        crane digest "$1"
    elif command -v skopeo >/dev/null 2>&1; then
        skopeo inspect --format '{{.Digest}}' "docker://$1"
    elif command -v docker >/dev/null 2>&1; then
        docker buildx imagetools inspect --format '{{.Manifest.Digest}}' "$1"
    else
        echo "$0: reading a digest needs crane, skopeo or docker buildx; none is installed" >&2
        return 3
    fi
}

pinned() {  # pinned IMAGE:TAG -> "sha256:..." or an error naming the image
    value=$(digest "$1") || { echo "$0: cannot read the digest of $1" >&2; exit 3; }
    case $value in
        sha256:????????????????????????????????????????????????????????????????) echo "$value" ;;
        *) echo "$0: $1: the registry answered '$value', not a sha256 digest" >&2; exit 3 ;;
    esac
}

images=$(sed -n 's/^ *image: *\([^ #]*\).*/\1/p' "$here/base/deployment.yaml" | sort -u)
out="$here/images/kustomization.yaml.tmp"
{
    echo "# Written by deploy/kubernetes/pin-images.sh $(date -u +%Y-%m-%dT%H:%M:%SZ): each image at the digest"
    echo "# its tag named then. Not kept in git; rerun the script to change it."
    echo "apiVersion: kustomize.config.k8s.io/v1alpha1"
    echo "kind: Component"
    echo "images:"
    for image in $images; do
        name=${image%:*}
        tag=${image##*:}
        if [ "$name" = "$placeholder" ]; then
            echo "  - name: $name"
            echo "    newName: ${trm%:*}"
            echo "    newTag: ${trm##*:}"
            echo "    digest: $(pinned "$trm")"
        else
            echo "  - name: $name"
            echo "    newTag: $tag"
            echo "    digest: $(pinned "$image")"
        fi
    done
} > "$out"
mv "$out" "$here/images/kustomization.yaml"
sed -n 's/^ *digest: //p;s/^  - name: //p' "$here/images/kustomization.yaml" | paste - - | sed 's/^/pinned /'
