#!/usr/bin/env bash
# Sourced by the GPU run scripts (run_tables_examples.sh, run_recurrent_decode.sh):
#
#   phase NAME BOUND_S COMMAND...
#
# runs COMMAND under its bound (coreutils timeout; T_<NAME> overrides the bound) when NAME
# is in $phases, logs it to $out/NAME.log, appends "name exit seconds bound" to
# $out/summary.tsv and sets status=1 when it fails. The caller sets out, phases, status.
phase() {
  local name=$1 bound=$2
  shift 2
  case " $phases " in *" $name "*) ;; *) return 0 ;; esac
  local var="T_${name^^}"
  bound=${!var:-$bound}
  local log="$out/$name.log" t0 t1 rc
  { printf "== phase %s (bound %s s):" "$name" "$bound"; printf " %q" "$@"; echo; } > "$log"
  t0=$(date +%s)
  timeout --kill-after=3 "$bound" "$@" >> "$log" 2>&1
  rc=$?
  t1=$(date +%s)
  printf '%s\t%d\t%d\t%d\n' "$name" "$rc" $((t1 - t0)) "$bound" >> "$out/summary.tsv"
  echo "phase $name: exit $rc after $((t1 - t0)) s (bound $bound s), log $log"
  [ "$rc" = 0 ] || status=1
}
