# call 3 of the sixteenth set, run on the warm machine after call 2 (store and llama.cpp build kept)
ROOT=/tmp/r3; mkdir -p $ROOT; T0=$(date +%s); export WHEELS=.whl-tf; source .ci/gpu-env >/dev/null 2>&1; M=/tmp/store/nemotron-3-nano-30b-a3b
trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
b() { local label=$1 path=$2; shift 2; PYTHONPATH=/tmp/site:$path timeout 120 $S bench model --model $M --vram-budget 8GiB --schedule direct --prompt-lengths 32 --decode-tokens 64 "$@" 2>&1 | grep -v "falling back" > $ROOT/$label.txt; echo "$label $(grep -E '^decode:' $ROOT/$label.txt | cut -c1-60)"; grep -E "hybrid:" $ROOT/$label.txt | cut -c1-150; }
timeout 60 /tmp/peer/lb/bin/llama-bench -m /tmp/gguf/nemotron-3-nano-30b-a3b.gguf -ngl 99 -fa on -t 16 -ncmoe 44 -lm none -p 0 -n 32 -r 3 2>&1 | grep -E "\| *tg" | tee $ROOT/llama-tg.txt
b prefill-quiet /tmp/pkg --routing uniform --prompt-lengths 512,2048 --decode-tokens 8; grep -A3 "^ *prompt " $ROOT/prefill-quiet.txt
for k in new base new2 base2; do p=/tmp/pkg; case $k in base*) p=/tmp/ab/base;; esac; [ $(( $(date +%s) - T0 )) -lt 380 ] || break
  b u-hybrid-$k $p --routing uniform --schedule direct-hybrid:compute.cpu_wait=device; done
[ $(( $(date +%s) - T0 )) -lt 400 ] && b u-direct /tmp/pkg --routing uniform
echo "[$(( $(date +%s) - T0 )) s] end"
