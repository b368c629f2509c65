//! Shell completion: clap's scripts, plus model names from corrald where a command takes
//! a stored model (bash and fish). The names come from `corralctl list --quiet`, which
//! reads without starting corrald and prints nothing when it is not running.

use clap_complete::Shell;

/// The subcommands whose positional argument is a stored model.
const TAKES_A_MODEL: &str = "show load unload stop rm push cp run";

/// Bash: a wrapper around clap's `_corralctl` that offers model names for the positional
/// argument of [`TAKES_A_MODEL`], and clap's completion everywhere else.  Names hold a
/// colon (`tiny:latest`), which bash splits words at: bash-completion's helpers, where
/// present, keep the name whole.
const BASH: &str = r#"
# Model names, from corrald (`corralctl list --quiet` never starts it).
_corralctl_with_models() {
    local cur prev word sub= i
    if declare -F _get_comp_words_by_ref >/dev/null; then
        _get_comp_words_by_ref -n : cur prev
    else
        cur=${COMP_WORDS[COMP_CWORD]}
        prev=${COMP_WORDS[COMP_CWORD-1]}
    fi
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        case $word in
            -*) ;;
            *) sub=$word; break ;;
        esac
    done
    case " @TAKES@ " in
        *" $sub "*)
            # Not an option, nor the value of one (-f FILE, --host URL, ...).
            if [[ $cur != -* && $prev != -* ]]; then
                local IFS=$'\n'
                COMPREPLY=($(compgen -W "$(corralctl list --quiet 2>/dev/null)" -- "$cur"))
                if declare -F __ltrim_colon_completions >/dev/null; then
                    __ltrim_colon_completions "$cur"
                fi
                return 0
            fi
            ;;
    esac
    _corralctl "$@"
}
if [[ "${BASH_VERSINFO[0]}" -eq 4 && "${BASH_VERSINFO[1]}" -ge 4 || "${BASH_VERSINFO[0]}" -gt 4 ]]; then
    complete -F _corralctl_with_models -o nosort -o bashdefault -o default corralctl
else
    complete -F _corralctl_with_models -o bashdefault -o default corralctl
fi
"#;

/// `script`, clap's completion for `shell`, with model names where the shell allows.
#[must_use]
pub fn with_model_names(shell: Shell, script: &str) -> String {
    match shell {
        Shell::Bash => format!("{script}{}", BASH.replace("@TAKES@", TAKES_A_MODEL)),
        Shell::Fish => format!(
            "{script}\n# Model names, from corrald (`corralctl list --quiet` never starts it).\n\
             complete -c corralctl -n \"__fish_seen_subcommand_from {TAKES_A_MODEL}\" -f -a \"(corralctl list --quiet 2>/dev/null)\"\n"
        ),
        _ => script.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap_complete::Shell;

    use super::with_model_names;
    use crate::ctl::cli::Cli;

    fn script(shell: Shell) -> String {
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "corralctl", &mut out);
        with_model_names(shell, &String::from_utf8_lossy(&out))
    }

    #[test]
    fn bash_and_fish_complete_model_names_from_list_quiet() {
        let bash = script(Shell::Bash);
        assert!(bash.contains("complete -F _corralctl_with_models"), "{bash}");
        assert!(bash.contains("corralctl list --quiet"), "{bash}");
        assert!(bash.contains(" show load unload stop rm push cp run "), "{bash}");
        let fish = script(Shell::Fish);
        assert!(fish.contains("__fish_seen_subcommand_from show load") && fish.contains("list --quiet"), "{fish}");
        // Every subcommand that takes a stored model is offered names.
        for sub in ["show", "load", "unload", "rm", "push", "cp", "run"] {
            assert!(Cli::command().find_subcommand(sub).is_some(), "{sub}");
        }
    }
}
