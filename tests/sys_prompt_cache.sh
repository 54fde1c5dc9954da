#!/bin/sh
# The prompt cache (lamina run --prompt-cache FILE), CPU backend, on a tiny qwen3next model
# (DeltaNet and attention layers, so the snapshot holds conv and delta states and KV rows):
#   1. a cache written after an 8-token prompt, then loaded by the 24-token prompt that starts
#      with it, gives the tokens of the run without a cache (-b 8: the same passes), greedy
#      and sampled; the file then holds the 24 tokens, and the same prompt again runs no
#      prompt token and still gives those tokens; one worker, two workers and --inproc (the
#      CPU forward and the cpu backend) read each other's files;
#   2. --prompt-cache-ro leaves the file as it was; another prompt, another model file,
#      another --kv-type, a cut file and header fields changed one at a time (version, model
#      hash, token count 0 or 2^32-1, state size, token ids outside the vocabulary with the
#      body checksum made to match, a token id, a state byte or the checksum changed: damage)
#      are named in a warning, run in full (the same tokens) and the file replaced; a file that
#      is not a prompt cache is refused and left intact;
#   3. refusals: --prompt-cache-ro alone, with --dump-logits, --backend without --inproc;
#   4. nothing left behind: no worker process, no /dev/shm segment, no temporary file.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
T=$(mktemp -d /tmp/lamina-pc-XXXXXX)
trap 'rm -rf "$T"' EXIT
. tests/lib/sys.sh
export LAMINA_LOG=info

$L gen-model --arch qwen3next --shape tiny --type q8_0 --seed 21 -o "$T/m.gguf" >/dev/null 2>&1 ||
    fail "gen-model"
$L gen-model --arch qwen3next --shape tiny --type q8_0 --seed 22 -o "$T/other.gguf" \
    >/dev/null 2>&1 || fail "gen-model (other)"
PRE=11,42,7,300,5,19,88,2
ALL=$PRE,64,9,13,250,77,31,4,120,6,99,18,45,3,210,17,56
# run TAG [args]: lamina run on the tiny model, stdout to $T/TAG.out, stderr to $T/TAG.err
run() {
    tag=$1
    shift
    $L run -m "$T/m.gguf" -n 12 -b 8 --no-echo "$@" >"$T/$tag.out" 2>"$T/$tag.err" &
    pid=$!
    wait $pid
    rc=$?
    check_clean "$tag" $pid
    return $rc
}
same() { # what, a, b
    if cmp -s "$T/$2.out" "$T/$3.out"; then ok "$1"; else fail "$1: '$(cat "$T/$2.out")' vs '$(cat "$T/$3.out")'"; fi
}
says() { # what, tag, text
    if grep -q "$3" "$T/$2.err"; then ok "$1"; else fail "$1: no '$3' in $(grep -E 'error|warn|prompt cache' "$T/$2.err" | head -3)"; fi
}

# 1. prefix, then the longer prompt, then the same again
run ref --prompt-ids $ALL --greedy || fail "reference run"
run refs --prompt-ids $ALL --temp 0.8 --seed 7 || fail "sampled reference run"
for where in "1w" "2w --devices cpu,cpu" "inproc --inproc" "inback --inproc --backend cpu"; do
    set -- $where
    w=$1
    shift
    rm -f "$T/pc.bin"
    run "$w-pre" --prompt-ids $PRE -n 0 --prompt-cache "$T/pc.bin" "$@" || fail "$w: prefix run"
    says "$w: the prefix is written" "$w-pre" "8 tokens written"
    run "$w-ext" --prompt-ids $ALL --greedy --prompt-cache "$T/pc.bin" "$@" || fail "$w: extended"
    says "$w: the prefix is loaded" "$w-ext" "8 of the prompt's 24 tokens loaded"
    says "$w: the longer prompt is written" "$w-ext" "24 tokens written"
    same "$w: prefix from the cache + the rest = the whole prompt (greedy)" ref "$w-ext"
    run "$w-full" --prompt-ids $ALL --greedy --prompt-cache "$T/pc.bin" "$@" || fail "$w: full hit"
    says "$w: the whole prompt is loaded" "$w-full" "24 of the prompt's 24 tokens loaded"
    says "$w: no prompt token runs" "$w-full" "prompt 24 tok (24 cached)"
    same "$w: whole prompt from the cache (greedy)" ref "$w-full"
    run "$w-samp" --prompt-ids $ALL --temp 0.8 --seed 7 --prompt-cache "$T/pc.bin" "$@" ||
        fail "$w: sampled"
    same "$w: whole prompt from the cache (sampled)" refs "$w-samp"
    cp "$T/pc.bin" "$T/pc-$w.bin"
done
# files of one path read by another
run x-2w --prompt-ids $ALL --greedy --prompt-cache "$T/pc-inproc.bin" --devices cpu,cpu ||
    fail "two workers on an --inproc file"
same "two workers continue from an --inproc file" ref x-2w
run x-in --prompt-ids $ALL --greedy --prompt-cache "$T/pc-2w.bin" --inproc ||
    fail "--inproc on a two-worker file"
same "--inproc continues from a two-worker file" ref x-in
if cmp -s "$T/pc-1w.bin" "$T/pc-inproc.bin" && cmp -s "$T/pc-2w.bin" "$T/pc-inback.bin"; then
    ok "one worker, two workers, the CPU forward and the cpu backend write the same bytes"
else
    fail "the paths' cache files differ"
fi

# 2. read-only, mismatches, damage, foreign files
cp "$T/pc-1w.bin" "$T/pc.bin"
run ro --prompt-ids $PRE,64,9 --greedy --prompt-cache "$T/pc.bin" --prompt-cache-ro ||
    fail "read-only run"
says "read-only: another prompt is named" ro "holds another prompt"
cmp -s "$T/pc.bin" "$T/pc-1w.bin" && ok "--prompt-cache-ro leaves the file" ||
    fail "--prompt-cache-ro changed the file"
run other --prompt-ids $PRE,64,9 --greedy --prompt-cache "$T/pc.bin" || fail "another prompt"
says "another prompt is run in full" other "holds another prompt, not a start of this one (10 of its 24"
says "and written" other "10 tokens written"
cp "$T/pc-1w.bin" "$T/pc.bin"
$L run -m "$T/other.gguf" -n 4 --no-echo --prompt-ids $ALL --prompt-cache "$T/pc.bin" \
    >/dev/null 2>"$T/om.err" || fail "another model's file"
says "another model's file is named" om "made for another model file"
cp "$T/pc-1w.bin" "$T/pc.bin"
run kv --prompt-ids $ALL --greedy --kv-type f32 --prompt-cache "$T/pc.bin" || fail "--kv-type f32"
says "another --kv-type is named" kv "made with another --kv-type"
head -c 3000 "$T/pc-1w.bin" >"$T/pc.bin"
run cut --prompt-ids $ALL --greedy --prompt-cache "$T/pc.bin" || fail "a cut file"
says "a cut file is named" cut "its size does not match its header"
same "a cut file: the prompt runs in full" ref cut
cmp -s "$T/pc.bin" "$T/pc-1w.bin" && ok "a cut file is replaced" || fail "a cut file stays"
# header fields changed one at a time (the file is untrusted input): each named, the prompt run
# in full with the reference's tokens, the file replaced; no crash
# edit OFFSET FORMAT VALUE [resum]: pc-1w.bin with that field rewritten, into pc.bin; resum:
# the header's body checksum made to match again (a crafted file: the checks behind it)
edit() {
    python3 - "$T/pc-1w.bin" "$T/pc.bin" "$1" "$2" "$3" "${4:-}" <<'PY'
import struct, sys
src, dst, off, fmt, val = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5], 0)
b = bytearray(open(src, 'rb').read())
struct.pack_into('<' + fmt, b, off, val)
M = (1 << 64) - 1
def pc_sum(p, h):  # coordinator/generate.c's pc_sum
    n = len(p) // 8 * 8
    for i in range(0, n, 8):
        h = ((h ^ int.from_bytes(p[i:i + 8], 'little')) * 0x100000001b3) & M
        h ^= h >> 29
    for x in p[n:]:
        h = ((h ^ x) * 0x100000001b3) & M
    return h
if sys.argv[6] == 'resum':
    n_tokens, n_vocab = struct.unpack_from('<II', b, 28)
    state = struct.unpack_from('<Q', b, 40)[0]
    ids, lg = 48, 48 + 4 * n_tokens
    h = pc_sum(b[ids:lg], 0xcbf29ce484222325)
    h = pc_sum(b[lg:lg + 4 * n_vocab], h)
    h = pc_sum(b[lg + 4 * n_vocab:lg + 4 * n_vocab + state], h)
    struct.pack_into('<I', b, 36, (h ^ h >> 32) & 0xffffffff)
open(dst, 'wb').write(b)
PY
}
size=$(stat -c %s "$T/pc-1w.bin")
for case in "8 I 1 - another format version" "8 I 3 - another format version" "16 Q 12345 - another model file" \
    "28 I 4294967295 - past the context" "28 I 0 - token count is 0" \
    "40 Q 16 - state size does not match" "48 i -5 resum outside the vocabulary" \
    "48 i 2147483647 resum outside the vocabulary" "48 i 7 - do not match its checksum" \
    "$((size - 8)) I 0x7fc00001 - do not match its checksum" "36 I 0 - do not match its checksum"; do
    set -- $case
    off=$1; fmt=$2; val=$3; sum=$4; shift 4
    edit "$off" "$fmt" "$val" "$sum"
    if run field --prompt-ids $ALL --greedy --prompt-cache "$T/pc.bin" &&
        grep -q "prompt cache .* not used: .*$*" "$T/field.err" && cmp -s "$T/ref.out" "$T/field.out"; then
        ok "header field at $off set to $val: named ($*), the prompt run in full"
    else
        fail "header field at $off set to $val: $(grep -E 'prompt cache|error' "$T/field.err" | head -2)"
    fi
done
printf 'precious user data\n' >"$T/notes.txt"
cp "$T/notes.txt" "$T/keep.txt"
if run foreign --prompt-ids $ALL --prompt-cache "$T/notes.txt"; then
    fail "a file that is not a prompt cache was accepted"
else
    says "a file that is not a prompt cache is refused" foreign "is not a lamina prompt cache"
fi
cmp -s "$T/notes.txt" "$T/keep.txt" && ok "and left intact" || fail "a foreign file was changed"

# 3. refusals
$L run -m "$T/m.gguf" --prompt-ids $ALL --prompt-cache-ro 2>"$T/r1.err" >/dev/null &&
    fail "--prompt-cache-ro alone accepted"
says "--prompt-cache-ro alone is refused" r1 "needs --prompt-cache FILE"
$L run -m "$T/m.gguf" --prompt-ids $ALL --prompt-cache "$T/x.bin" --dump-logits "$T/x.npy" \
    2>"$T/r2.err" >/dev/null && fail "--dump-logits with a cache accepted"
says "--dump-logits with a cache is refused" r2 "use one or the other"
$L run -m "$T/m.gguf" --prompt-ids $ALL --backend cpu 2>"$T/r3.err" >/dev/null &&
    fail "--backend without --inproc accepted"
says "--backend without --inproc is refused" r3 "give --inproc"

# 4. no temporary files
if ls "$T" | grep -q '\.tmp\.'; then fail "temporary files left: $(ls "$T" | grep '\.tmp\.')"; else
    ok "no temporary file left"; fi

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
