//! `usbwire detach -p PORT`: frees a vhci-hcd port (a relay serving it then ends).

use usbwire_client::vhci;

use crate::args::DetachArgs;
use crate::commands::common::stdout::outln;
use crate::exit::Failure;

pub(crate) fn run(args: DetachArgs) -> Result<(), Failure> {
    vhci::detach(args.port)?;
    outln!("port {} detached", args.port)
}
