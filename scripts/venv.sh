# Sourced by bootstrap.sh and genai_venv.sh (not run on its own).
#
# ensure_venv TOOL VENV STAMP_NAME VARIABLE CHECK WHAT
#   Make sure VENV is a working venv: CHECK, Python code run by its python, must succeed (pip importable, a
#   recent enough Python). A venv whose creation was interrupted (bin/python but no pip), or one of an older
#   Python, is made again; a folder holding anything but what a venv holds (and its install stamp,
#   STAMP_NAME) is refused, never removed: VARIABLE (the setting that named it) should name another folder.
#   WHAT says what VENV must be, for the messages ("a working venv").
ensure_venv() {
    local tool="$1" venv="$2" stamp_name="$3" variable="$4" check="$5" what="$6"
    if "$venv/bin/python" -c "$check" 2>/dev/null; then
        return
    fi
    if [ -e "$venv" ]; then
        if [ ! -d "$venv" ] || find "$venv" -mindepth 1 -maxdepth 1 ! -name bin ! -name include ! -name lib \
                ! -name lib64 ! -name pyvenv.cfg ! -name "$stamp_name" | grep -q .; then
            echo "$tool: $venv is not $what, and not only a venv: remove it yourself, or set $variable to" \
                 "another folder" >&2
            exit 1
        fi
        echo "$tool: $venv is not $what with pip: making it again" >&2
        rm -rf "$venv"
    fi
    python3 -m venv "$venv"
}
