export WHEELS=.whl-tf; source .ci/gpu-env >/dev/null 2>&1
SUP=$(slice_store nemotron-3.5-super:8 nvfp4)
$S bench model --model $SUP --compare direct-stream,overlap,direct-stream --vram-budget 8GiB --ram-cache 3050MB --cold --prompt-lengths 32 --decode-tokens 32 --json $OUT/stream.json 2>&1 | grep -v "falling back" > $OUT/stream.txt
tail -8 $OUT/stream.txt
SLUICE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x tests/test_direct.py -k "stream or table_reads" -p no:cacheprovider 2>&1 | tail -4
