#!/usr/bin/env bash
# Appends "unix_seconds, sm_clock_mhz, power_w, temperature_c" to $1 every
# ~100 ms until killed (run it in the background; clock_summary.py reads it).
while :; do
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    | sed "s/^/$(date +%s.%N), /"
  sleep 0.1
done >> "$1"
