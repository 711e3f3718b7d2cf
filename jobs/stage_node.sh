#!/bin/bash
# One node's part of STAGE_DATA (jobs/lib.sh, stage_data), run by srun as one task per node:
#   stage_node.sh SOURCE DEST BYTES REPORT   copy the folder SOURCE, or extract the tar SOURCE (compressed or
#       not), into DEST on this node's local disk, once its free space is checked against BYTES. A failure: exit
#       status 2, DEST removed, and the line naming this node, the cause and the way out written to REPORT.<node>
#       (on shared storage: the batch script says the first node's, once)
#   stage_node.sh --remove DEST              wait for the job's end (Slurm then ends this step), and for this node's
#       training on DEST to end too (a scancel or a preemption signals every step at once, and the ranks read on until
#       their checkpoint), at most until Slurm's KillWait is nearly spent; then remove DEST
#   stage_node.sh --data-dir DEST            print the folder --data-dir is: DEST, or the one folder at its top when
#       that holds train/ (a tar of the folder itself: tar -cf digits.tar digits)
set -uo pipefail
export LC_ALL=C  # tar's and cp's messages, matched below, in English
node=${SLURMD_NODENAME:-$(hostname)}  # Slurm's name for this node: two nodes may share a host or a hostname

# DEST, or its only folder (hidden entries aside: a Mac's ._ files) when that folder holds train/: the image folder
data_dir() {
    local entries
    mapfile -t entries < <(find "$1" -mindepth 1 -maxdepth 1 -not -name '.*')
    if [[ ${#entries[@]} -eq 1 && -d "${entries[0]}/train" ]]; then echo "${entries[0]}"; else echo "$1"; fi
}
if [[ "${1:-}" == --data-dir ]]; then
    data_dir "$2"
    exit 0
fi

human() {  # bytes, as du -h writes them
    numfmt --to=iec-i --suffix=B "$1" 2>/dev/null || echo "$1 bytes"
}

if [[ "${1:-}" == --remove ]]; then
    dest=$2
    # this node's training processes: their command lines hold --data-dir DEST, or the folder in it that a tar of the
    # folder itself holds (the path's regex characters escaped)
    # shellcheck disable=SC2001  # a set of characters escaped: sed, not ${var//}
    training="--data-dir $(sed 's/[][\\.*^$+?(){}|]/\\&/g' <<< "$dest")(/[^ ]*)?( |\$)"
    kill_wait=$(scontrol show config 2>/dev/null | awk '$1 == "KillWait" {print $3}')
    remove() {
        trap '' TERM INT HUP
        kill "$!" 2>/dev/null  # the sleep below
        local waited=0
        while pgrep -f -- "$training" > /dev/null && (( waited++ < 2 * (${kill_wait:-30} - 5) )); do
            sleep 0.5
        done
        rm -rf "$dest"
        echo "=== $node: removed the staged copy $dest"
        exit 0
    }
    trap remove TERM INT HUP
    while :; do sleep 3600 & wait $!; done
fi

src=$1 dest=$2 need=$3 report=$4
fail() {
    echo "$node: $1" > "$report.$node"
    rm -rf "$dest"
    exit 2
}
no_space() {
    fail "$(dirname "$dest") ran out of space while staging STAGE_DATA $src (it takes more than the $(human "$need") checked: a compressed archive's contents are larger, and small files take a disk block each): ask for a node with more local disk (#SBATCH --tmp=<size>, where the cluster grants it), or unset STAGE_DATA"
}
rm -rf "$dest"  # a copy left by a requeued run's cleanup that Slurm killed: not counted as free space
mkdir -p "$dest" 2>/dev/null || fail "cannot create $dest on the node's local disk: is $(dirname "$dest") there and writable?"
free=$(df -B1 --output=avail "$dest" | tail -n 1 | tr -d ' ')
if [[ "$free" =~ ^[0-9]+$ ]] && (( free < need )); then
    fail "$(dirname "$dest") has $(human "$free") free, but STAGE_DATA $src needs $(human "$need"): ask for a node with more local disk (#SBATCH --tmp=<size>, where the cluster grants it), or unset STAGE_DATA to read the data where they are"
fi
start=$(date +%s%N)
if [[ -d "$src" ]]; then
    # -L: a symbolic link's file, not the link (which would still point at shared storage)
    out=$(cp -aL "$src"/. "$dest"/ 2>&1) || { [[ "$out" == *"No space left"* ]] && no_space
        fail "copying STAGE_DATA $src into $dest failed (${out##*$'\n'})"; }
else
    # GNU tar recognises gzip, bzip2, xz and zstd itself; a truncated or corrupt archive fails here, before training
    out=$(tar -xf "$src" -C "$dest" 2>&1) || { [[ "$out" == *"No space left"* ]] && no_space
        fail "STAGE_DATA $src does not extract (${out##*$'\n'}): a truncated or corrupt archive? check it with tar -tf, and copy it again"; }
fi
seconds=$(( ($(date +%s%N) - start) / 1000000 ))
# --data-dir: the copy, or the one folder a tar of the folder itself holds (data_dir); its top level: train/ and test/
data=$(data_dir "$dest") is=""
[[ "$data" != "$dest" ]] && is="--data-dir is the one folder at its top, $data, which "
top=$(find "$data" -mindepth 1 -maxdepth 1 \( -type d -printf '%f/\n' -o -printf '%f\n' \) | sort | head -n 6 |
      paste -sd' ')
size=$(human "$(du -sb "$dest" | cut -f1)") files=$(find "$dest" -type f | wc -l)
took="$((seconds / 1000)).$(printf %03d $((seconds % 1000)))"
echo "=== $node: staged $size in $files files of $src into $dest in $took s; ${is:---data-dir }holds: ${top:-nothing}"
