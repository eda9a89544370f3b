# Sourced by scripts/setup.sh and scripts/check-wheel.sh: link_copy.
# A hard-linked copy of the environment $1 at $2: pip replaces a file by unlinking it first, so an
# install in one never writes into the other. bin/ and pyvenv.cfg are made anew for $2 (they name
# their environment); scripts in bin/ are copied with their first line pointing at $2's python,
# programs are linked.
link_copy() {
  cp -al "$1" "$2" || return 1
  rm -rf "$2/bin" "$2/pyvenv.cfg" "$2/.fastload-setup"
  "${python:-python3}" -m venv --without-pip "$2" || return 1
  local f name
  for f in "$1"/bin/*; do
    name="${f##*/}"
    [ -e "$2/bin/$name" ] || [ ! -f "$f" ] && continue
    if [ "$(head -c 2 "$f")" = "#!" ]; then
      sed "1s|^#!$1/bin/|#!$2/bin/|" "$f" > "$2/bin/$name" && chmod +x "$2/bin/$name" || return 1
    else
      ln "$f" "$2/bin/$name" || return 1
    fi
  done
}
