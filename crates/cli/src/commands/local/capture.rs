//! `usbwire capture DIR | --stop`: starts or stops the server's capture of every import.

use usbwire_server::ControlRequest;

use super::ask;
use crate::args::CaptureArgs;
use crate::commands::common::stdout::outln;
use crate::exit::Failure;

pub(crate) async fn run(args: CaptureArgs) -> Result<(), Failure> {
    // The server writes the files: an absolute path means the same to it as to us.
    let dir = match &args.dir {
        Some(dir) => Some(std::path::absolute(dir).map_err(|e| Failure::usage(e.into()))?),
        None => None,
    };
    ask(&args.control, ControlRequest::Capture { dir: dir.clone() }).await?;
    match dir {
        Some(dir) => outln!("capturing every import into {} (usbwire capture --stop ends it)", dir.display()),
        None => outln!("capture stopped"),
    }
}
