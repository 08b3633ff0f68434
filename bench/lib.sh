# Sourced by the bench scripts. `install_missing COMMAND=PACKAGE ...` installs from Debian the
# packages whose command is neither on PATH nor in /usr/sbin, when it can (root with apt-get);
# otherwise it says what to install and exits.
install_missing() {
    local missing=() pair cmd
    for pair in "$@"; do
        cmd=${pair%%=*}
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("${pair#*=}")
    done
    ((${#missing[@]})) || return 0
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    else
        echo "error: missing ${missing[*]}; install them (apt-get install ${missing[*]})" >&2
        exit 1
    fi
}
