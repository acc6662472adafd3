//! `usbwire type TEXT`: types on the server's virtual keyboard.

use usbwire_server::ControlRequest;

use super::ask;
use crate::args::TypeArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: TypeArgs) -> Result<(), Failure> {
    let response = ask(&args.control, ControlRequest::Type { text: args.text, busid: args.busid }).await?;
    tracing::debug!(reports = response.reports, "typed");
    Ok(())
}
