# call 2 (the machine held after call 1: store and llama.cpp build kept), tree 34ed986
export LIMIT=420; set -uo pipefail; ROOT=/tmp/r2; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,80p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
b 8g-skewed 8GiB skewed /tmp/pkg --prompt-lengths 32,512 && grep -A3 "^ *prompt " $ROOT/8g-skewed.txt | tail -2
BT=120 b 8g-prefill-quiet 8GiB uniform /tmp/pkg --prompt-lengths 512,2048 --decode-tokens 8 && grep -A3 "^ *prompt " $ROOT/8g-prefill-quiet.txt
hd u-hybrid-3; hd u-hybrid-4
timeout 60 /tmp/peer/lb/bin/llama-bench -m $G -ngl 99 -fa on -t 16 -ncmoe 44 -lm none -p 512 -n 32 -r 2 2>&1 | grep -E "\| *(tg|pp)" | cut -c90- | tee $ROOT/llama.txt
[ $(left) -gt 60 ] && b 8g-prefill-empty 8GiB uniform /tmp/pkg --schedule direct:fetch.vram_fill=false --prompt-lengths 512 --decode-tokens 8 && grep -A2 "^ *prompt " $ROOT/8g-prefill-empty.txt
el end
