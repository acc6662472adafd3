//! `usbwire completions SHELL` and `usbwire man`: shell completion scripts
//! and man pages, generated from the clap definitions so they never drift
//! from the real flags.

use std::path::Path;

use anyhow::Context as _;
use clap::CommandFactory;

use crate::args::{Cli, CompletionsArgs, ManArgs};
use crate::exit::Failure;

pub(crate) fn completions(args: CompletionsArgs) -> Result<(), Failure> {
    let mut command = Cli::command();
    clap_complete::generate(args.shell, &mut command, "usbwire", &mut std::io::stdout());
    Ok(())
}

pub(crate) fn man(args: ManArgs) -> Result<(), Failure> {
    let command = Cli::command();
    let Some(dir) = args.dir else {
        return render(&command, &mut std::io::stdout().lock()).map_err(Failure::io);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display())).map_err(Failure::io)?;
    let written = write_pages(&command, "usbwire", &dir).map_err(Failure::io)?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}

/// `name.1` for `command`, then one page per subcommand (`name-sub.1`).
fn write_pages(command: &clap::Command, name: &str, dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let path = dir.join(format!("{name}.1"));
    let mut file = std::fs::File::create(&path).with_context(|| format!("cannot write {}", path.display()))?;
    render(&command.clone().name(name.to_owned()), &mut file)?;
    let mut written = vec![path];
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        written.extend(write_pages(sub, &format!("{name}-{}", sub.get_name()), dir)?);
    }
    Ok(written)
}

/// The page clap's definitions give, then the EXIT STATUS section ([`crate::exit::EXIT_CODES`]).
fn render(command: &clap::Command, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    clap_mangen::Man::new(command.clone()).render(out).context("cannot write the man page")?;
    out.write_all(crate::exit::man_section().as_bytes()).context("cannot write the man page")
}
