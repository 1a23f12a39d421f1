#!/usr/bin/env bash
# ext4.sh served with a 64 KiB map cache: ten block map pages
# (5,120 blocks' entries) fit in it, far fewer than mkfs, the copy, fsck and
# the diff after a restart touch, so they run with map pages dropped and
# read back from the volume all the time. The restarted server's
# map_cache_misses must be non-zero, or paging was not tested.
#
#   E2E_EXT4_SIZE  volume size (default 2G)
export E2E_EXT4_SIZE=${E2E_EXT4_SIZE:-2G}
export E2E_SERVE_ARGS="--map-cache 64K ${E2E_SERVE_ARGS:-}"
export E2E_EXPECT_MAP_MISSES=1
exec bash "$(dirname "$0")/ext4.sh"
