# The step runner of bench/gpu_check.sh (sourced, not run): each step under a hard time limit, its
# status (ran / failed / skipped: reason), seconds and key number recorded, the next step run
# whatever happened, and one table printed last and kept in $OUT.
#
#   steps_init "a b c"        the known steps, in order; STEPS (comma or space separated) picks
#                             some, else all; an unknown name is an error before anything runs
#   step NAME LIMIT CMD...    run CMD (a command or an exported function) if NAME is picked,
#                             under min(LIMIT or $LIMIT_<NAME>, time left before DEADLINE)
#   steps_summary             print the table (last); $OUT/summary.txt holds it, rewritten
#                             after every step
#
# Inside a step (exported, for the step's own bash):
#   skip REASON       end the step as "skipped: REASON" (exit 77): it did not run
#   note TEXT         the step's key number, shown in the table
#   keep FILE [NAME]  copy FILE into $OUT as NAME (gzipped when over 15 MiB): $OUT keeps at most
#                     OUT_FILES files: a GPU machine run returns 8 files of up to 16 MiB
#   run_logged CMD..  run CMD, its output shown and saved as $STEP_DIR/out; CMD's exit status

: "${OUT:?set OUT before sourcing gpu_steps.sh}"
: "${SCRATCH:?set SCRATCH (a scratch folder for the steps) before sourcing gpu_steps.sh}"
DEADLINE=${DEADLINE:-470}      # seconds for the whole run
KILL_AFTER=${KILL_AFTER:-5}    # seconds between a step's TERM and KILL
MIN_LIMIT=${MIN_LIMIT:-10}     # a step with less time than this left is not started
OUT_FILES=${OUT_FILES:-8}
STEPS_T0=${STEPS_T0:-$(date +%s)}
STEP_ROWS=()
export OUT SCRATCH OUT_FILES

elapsed() { echo $(( $(date +%s) - STEPS_T0 )); }

steps_init() {
  KNOWN_STEPS=($1)
  local steps=${STEPS:-} name
  local picked=(${steps//,/ })
  (( ${#picked[@]} )) || picked=("${KNOWN_STEPS[@]}")
  for name in "${picked[@]}"; do
    if [[ " ${KNOWN_STEPS[*]} " != *" $name "* ]]; then
      echo "STEPS=$STEPS: unknown step '$name'; the steps are: ${KNOWN_STEPS[*]}" >&2
      return 2
    fi
  done
  PICKED=" ${picked[*]} "
}

skip() { echo "$*" > "$STEP_DIR/skip"; exit 77; }
note() { echo "$*" >> "$STEP_DIR/note"; }
run_logged() { "$@" 2>&1 | tee "$STEP_DIR/out"; return "${PIPESTATUS[0]}"; }

keep() {
  local src=$1 name=${2:-$(basename "$1")}
  if [[ ! -f $src ]]; then echo "keep: no file $src"; return 1; fi
  if [[ ! $name =~ ^[A-Za-z0-9._-]+$ ]]; then echo "keep: bad name '$name'"; return 1; fi
  if (( $(stat -c %s "$src") > 15 * 2**20 )); then
    gzip -c "$src" > "$SCRATCH/$name.gz" && src=$SCRATCH/$name.gz name=$name.gz
    if (( $(stat -c %s "$src") > 15 * 2**20 )); then echo "keep: $name over 15 MiB"; return 1; fi
  fi
  if [[ ! -e $OUT/$name ]] && (( $(find "$OUT" -type f | wc -l) >= OUT_FILES )); then
    echo "keep: $OUT holds $OUT_FILES files already; $name not kept"
    return 1
  fi
  cp "$src" "$OUT/$name" && echo "kept $OUT/$name"
}
export -f skip note keep run_logged

# record NAME STATUS SECONDS KEY
record() {
  local key=${4//'|'/'/'}
  STEP_ROWS+=("$1|$2|$3|$key")
  write_summary
}

step() {
  local name=$1 limit=$2; shift 2
  [[ $PICKED == *" $name "* ]] || return 0
  local var="LIMIT_${name//-/_}"
  limit=${!var:-$limit}
  local left=$(( DEADLINE - $(elapsed) - KILL_AFTER ))
  (( limit > left )) && limit=$left
  if (( limit < MIN_LIMIT )); then
    record "$name" "skipped: no time left before the ${DEADLINE} s deadline" 0 ""
    return 0
  fi
  export STEP_DIR=$SCRATCH/step-$name
  mkdir -p "$STEP_DIR"
  echo; echo "== $name (limit ${limit} s, at $(elapsed) s) =="
  local t0 rc status
  t0=$(date +%s)
  # bash -c: the step may be an exported function, which timeout cannot exec itself.
  timeout --kill-after="$KILL_AFTER" "$limit" bash -c '"$@"' _ "$@"
  rc=$?
  case $rc in
    0) status=ran ;;
    77) status="skipped: $(cat "$STEP_DIR/skip" 2>/dev/null || echo 'no reason given')" ;;
    124|137) status="failed: timeout after ${limit} s" ;;
    *) status="failed (rc $rc)" ;;
  esac
  record "$name" "$status" $(( $(date +%s) - t0 )) "$(paste -sd ';' "$STEP_DIR/note" 2>/dev/null)"
}

# $OUT/summary.txt: the table of the steps so far (rewritten after each, so a run cut short
# still leaves one).
write_summary() {
  local row name status secs key
  {
    echo "== summary ($(date '+%Y-%m-%d %H:%M'), $(elapsed) s in all; files in $OUT) =="
    printf '%-9s %-44s %7s  %s\n' step status seconds "key number"
    for row in "${STEP_ROWS[@]}"; do
      IFS='|' read -r name status secs key <<<"$row"
      printf '%-9s %-44s %7s  %s\n' "$name" "$status" "$secs" "$key"
    done
  } > "$OUT/summary.txt"
}

# Print the table (the run's last lines); returns the number of failed steps.
steps_summary() {
  local row failed=0
  write_summary
  echo
  cat "$OUT/summary.txt"
  for row in "${STEP_ROWS[@]}"; do
    [[ $row == *"|failed"* ]] && failed=$((failed + 1))
  done
  return "$failed"
}
