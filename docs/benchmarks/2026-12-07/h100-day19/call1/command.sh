# call 1 (a fresh H100 machine), tree b7fd449
LIMIT=555 PART=day bash .ci/gpu-day   # cut by its time after the two runs of the CPU's share
