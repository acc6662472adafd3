//! What several verbs share, so that no verb borrows from another's module:
//! reaching a server ([`peer`]), the lab registry ([`registry`]), the
//! process around a command ([`process`]), printed output ([`stdout`],
//! [`output`], [`usb_names`], [`description`], [`device_json`]) and building a local server
//! ([`local_server`]).

pub(crate) mod description;
pub(crate) mod device_json;
pub(crate) mod local_server;
pub(crate) mod output;
pub(crate) mod peer;
pub(crate) mod process;
pub(crate) mod registry;
pub(crate) mod stdout;
pub(crate) mod usb_names;
