//! The other end, in Rust: a device process's side of the protocol, for
//! programs (and tests) that serve a device to a server from Rust. A
//! [`Handler`] answers requests; [`serve`] speaks the frames over a stream.
//! [`Echo`] is the smallest useful device: what is written to its bulk OUT
//! endpoint comes back from its bulk IN endpoint.
//!
//! Not the server's side (that is [`crate::core`]), and not for the Python
//! library, which speaks the same frames on its own.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use usbwire_device::control::{request, SetupPacket};
use usbwire_device::descriptor::{self, ConfigurationBuilder, DeviceDescriptor, EndpointSpec};
use usbwire_device::Speed;

use crate::codec::{self, Message, VERSION};

/// How a device process answers one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Data(Bytes),
    Ack,
    Stall,
    /// Not ready: an IN request waits until [`Handler::poll_in`] has data.
    Nak,
}

/// A device, as a device process sees it.
pub trait Handler {
    /// The speed and bMaxPacketSize0 its hello announces.
    fn hello(&self) -> (Speed, u8);
    /// A control request on ep0 (`data` is its OUT data stage).
    fn control(&mut self, setup: SetupPacket, data: &[u8]) -> Answer;
    /// OUT data for `endpoint`.
    fn out(&mut self, endpoint: u8, data: &[u8]) -> Answer;
    /// Data for a waiting IN request on `endpoint`, up to `length` bytes, if there is some now.
    fn poll_in(&mut self, endpoint: u8, length: u32) -> Option<Answer>;
    /// A USB reset.
    fn reset(&mut self);
}

/// Why [`serve`] ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Codec(#[from] codec::CodecError),
    /// The server refused the device, saying why.
    #[error("refused by the server: {0}")]
    Refused(String),
}

/// Says hello and serves `handler` until the server closes the connection.
pub async fn serve<S, H>(mut stream: S, handler: &mut H) -> Result<(), ServeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    H: Handler,
{
    let (speed, ep0_max_packet) = handler.hello();
    let mut out = BytesMut::new();
    Message::Hello { version: VERSION, speed, ep0_max_packet }.encode(&mut out);
    stream.write_all(&out).await?;
    let mut input = BytesMut::with_capacity(1 << 16);
    // IN requests answered NAK, oldest first: (id, endpoint, length).
    let mut waiting: VecDeque<(u32, u8, u32)> = VecDeque::new();
    loop {
        out.clear();
        while let Some(message) = codec::decode(&mut input)? {
            let answer = match message {
                Message::Welcome { .. } => None,
                Message::Refuse { reason } => return Err(ServeError::Refused(reason)),
                Message::Setup { id, setup, data } => Some((id, handler.control(SetupPacket::parse(&setup), &data))),
                Message::Out { id, endpoint, data } => Some((id, handler.out(endpoint, &data))),
                Message::In { id, endpoint, length } => {
                    waiting.push_back((id, endpoint, length));
                    Some((id, Answer::Nak))
                }
                Message::Cancel { id } => {
                    waiting.retain(|(waiting_id, _, _)| *waiting_id != id);
                    None
                }
                Message::Reset => {
                    waiting.clear();
                    handler.reset();
                    None
                }
                // Only a device process sends these; a server never does.
                Message::Hello { .. }
                | Message::Data { .. }
                | Message::Ack { .. }
                | Message::Nak { .. }
                | Message::Stall { .. } => None,
            };
            if let Some((id, answer)) = answer {
                encode_answer(id, answer, &mut out);
            }
        }
        answer_waiting(handler, &mut waiting, &mut out);
        stream.write_all(&out).await?;
        if stream.read_buf(&mut input).await? == 0 {
            return Ok(());
        }
    }
}

/// Answers waiting IN requests, oldest first per endpoint, while the handler has data.
fn answer_waiting<H: Handler>(handler: &mut H, waiting: &mut VecDeque<(u32, u8, u32)>, out: &mut BytesMut) {
    let mut blocked = Vec::new();
    waiting.retain(|&(id, endpoint, length)| {
        if blocked.contains(&endpoint) {
            return true;
        }
        match handler.poll_in(endpoint, length) {
            Some(answer) => {
                encode_answer(id, answer, out);
                false
            }
            None => {
                blocked.push(endpoint);
                true
            }
        }
    });
}

fn encode_answer(id: u32, answer: Answer, out: &mut BytesMut) {
    match answer {
        Answer::Data(data) => Message::Data { id, data },
        Answer::Ack => Message::Ack { id },
        Answer::Stall => Message::Stall { id },
        Answer::Nak => Message::Nak { id },
    }
    .encode(out);
}

/// A vendor-class echo device (`1209:000e`): bulk OUT `0x02` in, bulk IN `0x81` out.
#[derive(Debug)]
pub struct Echo {
    speed: Speed,
    device: DeviceDescriptor,
    configuration: Vec<u8>,
    strings: Vec<String>,
    /// What was written and not yet read back, one OUT transfer per entry.
    echo: VecDeque<Bytes>,
    /// The most bytes it keeps before NAKing OUT data.
    capacity: usize,
    configured: u8,
}

impl Echo {
    pub fn new(serial: &str) -> Self {
        let speed = Speed::HIGH;
        let mut device = DeviceDescriptor::for_speed(speed, 0x1209, 0x000e);
        device.class = 0xff;
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(0, 2, 0xff, 0, 0, 0)
            .endpoint(EndpointSpec::bulk(0x81, speed))
            .endpoint(EndpointSpec::bulk(0x02, speed))
            .build();
        let strings = vec!["usbwire".to_owned(), "usbwire echo".to_owned(), serial.to_owned()];
        Self { speed, device, configuration, strings, echo: VecDeque::new(), capacity: 1 << 20, configured: 0 }
    }
}

impl Handler for Echo {
    fn hello(&self) -> (Speed, u8) {
        (self.speed, self.device.max_packet_size0)
    }

    fn control(&mut self, setup: SetupPacket, _data: &[u8]) -> Answer {
        let reply = match (setup.request_type, setup.request) {
            (0x80, request::GET_DESCRIPTOR) => match setup.descriptor_type() {
                descriptor::DEVICE => Some(self.device.to_bytes()),
                descriptor::CONFIGURATION if setup.descriptor_index() == 0 => Some(self.configuration.clone()),
                descriptor::STRING => descriptor::string_descriptor(&self.strings, setup.descriptor_index()),
                _ => None,
            },
            (0x80, request::GET_CONFIGURATION) => Some(vec![self.configured]),
            (0x80..=0x82, request::GET_STATUS) => Some(vec![0, 0]),
            (0x00, request::SET_CONFIGURATION) if setup.value <= 1 => {
                self.configured = setup.value as u8;
                Some(Vec::new())
            }
            (0x01, request::SET_INTERFACE) if setup.value == 0 => Some(Vec::new()),
            (0x02, request::CLEAR_FEATURE) => Some(Vec::new()),
            _ => None,
        };
        match reply {
            Some(mut data) if setup.is_in() => {
                data.truncate(usize::from(setup.length));
                Answer::Data(data.into())
            }
            Some(_) => Answer::Ack,
            None => Answer::Stall,
        }
    }

    fn out(&mut self, _endpoint: u8, data: &[u8]) -> Answer {
        if self.echo.iter().map(Bytes::len).sum::<usize>() + data.len() > self.capacity {
            return Answer::Stall;
        }
        self.echo.push_back(Bytes::copy_from_slice(data));
        Answer::Ack
    }

    fn poll_in(&mut self, _endpoint: u8, length: u32) -> Option<Answer> {
        let front = self.echo.front_mut()?;
        let data = front.split_to(front.len().min(length as usize));
        if front.is_empty() {
            self.echo.pop_front();
        }
        Some(Answer::Data(data))
    }

    fn reset(&mut self) {
        self.echo.clear();
        self.configured = 0;
    }
}
