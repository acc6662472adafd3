//! `usbwire completions SHELL` and `usbwire man`: shell completion scripts
//! and man pages, generated from the clap definitions so they never drift
//! from the real flags, with the manual's own sections after them
//! (examples, environment, files: `crate::manual`; exit status:
//! `crate::exit::EXIT_CODES`), and usbwire.toml(5) for the configuration
//! files' keys.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::common::stdout::{self, outln};
use crate::args::{CompletionsArgs, ManArgs};
use crate::exit::Failure;
use crate::manual;
use crate::version::VERSION;

pub(crate) fn completions(args: CompletionsArgs) -> Result<(), Failure> {
    let mut command = crate::args::command();
    // Into memory first: `generate` panics on a write error, a closed stdout among them.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "usbwire", &mut script);
    stdout::write_bytes(&script)
}

/// The command line as the man pages show it: one version line (the title
/// takes it), and no `help` verb of its own (`usbwire help VERB` is `--help`).
fn man_command() -> clap::Command {
    crate::args::command().disable_help_subcommand(true).version(VERSION)
}

pub(crate) fn man(args: ManArgs) -> Result<(), Failure> {
    let command = man_command();
    let Some(dir) = args.dir else {
        let mut page = Vec::new();
        render(&command, None, &mut page).map_err(Failure::software)?;
        return stdout::write_bytes(&page);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display())).map_err(Failure::io)?;
    let mut written = write_pages(&command, "usbwire", None, &dir).map_err(Failure::io)?;
    let config_page = section_five_dir(&dir).join("usbwire.toml.5");
    std::fs::write(&config_page, config_page_text())
        .with_context(|| format!("cannot write {}", config_page.display()))
        .map_err(Failure::io)?;
    written.push(config_page);
    for path in written {
        outln!("{}", path.display())?;
    }
    Ok(())
}

/// Where usbwire.toml(5) goes: beside section 1's pages, or in `man5` when
/// they go in a `man1` directory (`/usr/local/share/man/man1`), where man
/// looks for section 5.
fn section_five_dir(dir: &Path) -> PathBuf {
    match (dir.file_name(), dir.parent()) {
        (Some(name), Some(parent)) if name == "man1" => {
            let five = parent.join("man5");
            if std::fs::create_dir_all(&five).is_ok() {
                five
            } else {
                dir.to_path_buf()
            }
        }
        _ => dir.to_path_buf(),
    }
}

/// `name.1` for `command`, then one page per subcommand (`name-sub.1`).
fn write_pages(command: &clap::Command, name: &str, verb: Option<&str>, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let path = dir.join(format!("{name}.1"));
    let mut file = std::fs::File::create(&path).with_context(|| format!("cannot write {}", path.display()))?;
    render(&command.clone().name(name.to_owned()), verb, &mut file)?;
    let mut written = vec![path];
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let sub_name = sub.get_name();
        written.extend(write_pages(sub, &format!("{name}-{sub_name}"), Some(sub_name), dir)?);
    }
    Ok(written)
}

/// clap_mangen's sections (name, synopsis, description, options,
/// commands), then the manual's: `verb` `None` is usbwire(1).
fn render(command: &clap::Command, verb: Option<&str>, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let man = clap_mangen::Man::new(command.clone());
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(out)?;
    }
    if command.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(out)?;
    }
    out.write_all(manual_sections(verb).as_bytes()).context("cannot write the man page")?;
    if verb.is_none() {
        man.render_version_section(out)?;
    }
    Ok(())
}

/// A line of text for roff: backslashes and hyphens escaped, and a leading
/// `.` or `'` kept from reading as a request.
fn roff(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

/// `.TP` entries: each term in bold, its meaning under it.
fn tagged(out: &mut String, entries: impl IntoIterator<Item = (String, String)>) {
    for (term, meaning) in entries {
        let _ = write!(out, ".TP\n\\fB{}\\fR\n{}\n", roff(&term), roff(&meaning));
    }
}

/// EXAMPLES and EXIT STATUS ([`crate::exit::EXIT_CODES`]) on every page;
/// ENVIRONMENT and FILES on usbwire(1); SEE ALSO.
fn manual_sections(verb: Option<&str>) -> String {
    let mut out = String::new();
    let examples = manual::examples(verb);
    if !examples.is_empty() {
        out.push_str(".SH EXAMPLES\n");
        tagged(&mut out, examples.iter().map(|e| (e.command.to_owned(), e.what.to_owned())));
    }
    out.push_str(&crate::exit::man_section());
    if verb.is_none() {
        out.push_str(".SH ENVIRONMENT\n");
        tagged(&mut out, manual::ENVIRONMENT.iter().map(|(name, meaning)| ((*name).to_owned(), (*meaning).to_owned())));
        out.push_str(".SH FILES\n");
        tagged(&mut out, manual::FILES.iter().map(|(path, meaning)| ((*path).to_owned(), (*meaning).to_owned())));
        out.push_str(".SH \"SEE ALSO\"\nusbwire.toml(5), usbip(8), usbipd(8)\n");
    } else {
        out.push_str(".SH \"SEE ALSO\"\nusbwire(1) (environment, files), usbwire.toml(5)\n");
    }
    out
}

/// usbwire.toml(5): every key of the server's, the client service's and the
/// user's configuration files.
fn config_page_text() -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        ".TH usbwire.toml 5 \"\" \"usbwire {}\"\n.SH NAME\nusbwire.toml \\- usbwire's configuration files\n",
        roff(VERSION)
    );
    out.push_str(".SH DESCRIPTION\n");
    out.push_str(&roff(
        "usbwire reads three TOML files. A key that is not listed here is refused with the line it is on and the \
         keys that table takes. Sizes are bytes or a number with K, M or G; durations are like 3s, 10m or 1h30m; \
         selectors are a bus id (1-1.2), VID:PID in hex, serial=TEXT or class=HEX.",
    ));
    out.push('\n');
    tagged(&mut out, manual::CONFIG_FILES.iter().map(|(file, what)| (format!("the {file} file"), (*what).to_owned())));
    for (file, _) in manual::CONFIG_FILES {
        let _ = writeln!(out, ".SH \"THE {} FILE\"", file.to_uppercase());
        for table in manual::CONFIG.iter().filter(|t| t.file == *file) {
            let heading = if table.table.is_empty() { "top level" } else { table.table };
            let _ = writeln!(out, ".SS \"{}\"", roff(heading));
            tagged(
                &mut out,
                table.rows().into_iter().map(|(key, value, meaning)| (format!("{key} = {value}"), meaning)),
            );
        }
    }
    out.push_str(".SH EXAMPLES\n.nf\n");
    for line in [
        "# /etc/usbwire/server.toml",
        "listen = \"0.0.0.0:3240\"",
        "http = \"127.0.0.1:8324\"",
        "",
        "[[virtual]]",
        "kind = \"disk\"",
        "path = \"/var/lib/usbwire/disk.img\"",
        "size = \"1G\"",
        "",
        "[[bind]]",
        "device = \"0781:5567\"",
        "",
        "# ~/.config/usbwire/usbwire.toml",
        "[registry]",
        "endpoints = [\"10.0.0.5:2379\"]",
    ] {
        let _ = writeln!(out, "{}", roff(line));
    }
    out.push_str(".fi\n.SH \"SEE ALSO\"\nusbwire(1), usbwire\\-serve(1), usbwire\\-client(1)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roff_text_cannot_start_a_request() {
        assert_eq!(roff(".hidden"), "\\&.hidden");
        assert_eq!(roff("a-b\\c"), "a\\-b\\ec");
    }

    #[test]
    fn the_program_page_has_its_sections_and_no_help_verb() {
        let mut page = Vec::new();
        render(&man_command(), None, &mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        for section in [".SH EXAMPLES", ".SH \"EXIT STATUS\"", ".SH ENVIRONMENT", ".SH FILES", "usbwire.toml(5)"] {
            assert!(page.contains(section), "{section} missing");
        }
        assert!(!page.contains("usbwire\\-help"), "no page exists for a help verb");
    }
}
