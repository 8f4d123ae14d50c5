# call 3 (held), the same tree (b7fd449)
export LIMIT=330; set -uo pipefail; ROOT=/tmp/r3; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,90p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
b 8g-skewed-hybrid-device 8GiB skewed /tmp/pkg --schedule direct-hybrid:compute.cpu_wait=device
b 8g-skewed-direct 8GiB skewed /tmp/pkg
hd 8g-uniform-hybrid-device-3
b 8g-skewed-hybrid-device-2 8GiB skewed /tmp/pkg --schedule direct-hybrid:compute.cpu_wait=device
