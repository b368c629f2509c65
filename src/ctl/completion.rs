//! Shell completion: clap's scripts, plus model names from corrald where a command takes
//! a stored model (bash, zsh and fish). The names come from `corralctl list --quiet`, which
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

/// zsh: a function offering model names, defined before clap's `_corralctl` (which runs as
/// soon as the file is autoloaded); [`zsh`] points the stored-model arguments at it.
/// `compadd -a` takes the names whole, colons and all.
const ZSH_MODELS: &str = r#"
# Model names, from corrald (`corralctl list --quiet` never starts it).
(( $+functions[_corralctl_models] )) ||
_corralctl_models() {
    local -a names
    names=(${(f)"$(corralctl list --quiet 2>/dev/null)"})
    compadd -a names
}
"#;

/// clap's zsh script with the arguments that name a stored model (not a new name, nor a
/// registry's) completed by `_corralctl_models`.
fn zsh(script: &str) -> String {
    let stored = |line: &str| {
        let line = line.trim_start();
        (line.starts_with("':model -- The model'\\''s name") && !line.contains("with its registry"))
            || line.starts_with("':source -- ")
            || line.starts_with("'*::models -- ")
    };
    let mut out = String::with_capacity(script.len() + ZSH_MODELS.len());
    for (i, line) in script.lines().enumerate() {
        match line.rfind(":_default'") {
            Some(at) if stored(line) => {
                out.push_str(&line[..at]);
                out.push_str(":_corralctl_models'");
                out.push_str(&line[at + ":_default'".len()..]);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
        // After `#compdef corralctl`, the first line.
        if i == 0 {
            out.push_str(ZSH_MODELS);
        }
    }
    out
}

/// `script`, clap's completion for `shell`, with model names where the shell allows.
#[must_use]
pub fn with_model_names(shell: Shell, script: &str) -> String {
    match shell {
        Shell::Bash => format!("{script}{}", BASH.replace("@TAKES@", TAKES_A_MODEL)),
        Shell::Fish => format!(
            "{script}\n# Model names, from corrald (`corralctl list --quiet` never starts it).\n\
             complete -c corralctl -n \"__fish_seen_subcommand_from {TAKES_A_MODEL}\" -f -a \"(corralctl list --quiet 2>/dev/null)\"\n"
        ),
        Shell::Zsh => zsh(script),
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
        let zsh = script(Shell::Zsh);
        assert!(zsh.starts_with("#compdef corralctl\n\n# Model names") && zsh.contains("list --quiet"), "{zsh}");
        let completed: Vec<&str> = zsh.lines().filter(|l| l.contains(":_corralctl_models'")).collect();
        // show, load, unload (stop), rm, cp's source, run; not create's new name, cp's
        // destination, nor a registry's names (pull, push).
        assert!(completed.iter().any(|l| l.contains("':source -- ")), "{completed:?}");
        assert!(completed.iter().any(|l| l.contains("'*::models -- ")), "{completed:?}");
        assert!(completed.len() >= 6, "{completed:?}");
        assert!(completed.iter().all(|l| !l.contains("new model") && !l.contains("registry")), "{completed:?}");
        assert!(zsh.contains("':destination -- The new name:_default'"), "{zsh}");
        // Every subcommand that takes a stored model is offered names.
        for sub in ["show", "load", "unload", "rm", "push", "cp", "run"] {
            assert!(Cli::command().find_subcommand(sub).is_some(), "{sub}");
        }
    }
}
