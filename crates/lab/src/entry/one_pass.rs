//! Reading a [`DeviceEntry`] in one pass over its JSON: the fields beside the
//! device record (`schema_version`, `server`, `class`, `interface_classes`,
//! `labels`) are taken as they come, and every other key goes on to
//! [`DeviceJson`]'s own derived reader. It reads what serde's
//! `#[serde(flatten)]` derive reads, without buffering every field of the
//! record first, and without reading the text twice (once a part, each
//! ignoring the other's fields): a full list decodes 100 000 entries.
//!
//! Not for writing entries (the derived `Serialize`), nor for deciding which
//! entries a reader keeps (`decode_str`: schema versions).

use std::borrow::Cow;
use std::fmt;

use serde::de::value::{MapAccessDeserializer, StrDeserializer};
use serde::de::{DeserializeSeed, Error as _, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use usbwire_device::record::DeviceJson;

use super::DeviceEntry;

/// The fields beside the record, as far as read.
#[derive(Default)]
struct Beside {
    schema_version: Option<u32>,
    server: Option<String>,
    class: Option<String>,
    interface_classes: Option<Vec<String>>,
    labels: Option<Vec<String>>,
}

impl<'de> Deserialize<'de> for DeviceEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(EntryVisitor)
    }
}

struct EntryVisitor;

impl<'de> Visitor<'de> for EntryVisitor {
    type Value = DeviceEntry;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a device entry")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<DeviceEntry, A::Error> {
        let mut beside = Beside::default();
        let record = DeviceJson::deserialize(MapAccessDeserializer::new(Sifted { map, beside: &mut beside }))?;
        Ok(DeviceEntry {
            schema_version: beside.schema_version.ok_or_else(|| A::Error::missing_field("schema_version"))?,
            server: beside.server.ok_or_else(|| A::Error::missing_field("server"))?,
            record,
            class: beside.class.ok_or_else(|| A::Error::missing_field("class"))?,
            interface_classes: beside.interface_classes.ok_or_else(|| A::Error::missing_field("interface_classes"))?,
            labels: beside.labels.ok_or_else(|| A::Error::missing_field("labels"))?,
        })
    }
}

/// The entry's map as the record's reader sees it: the fields beside the
/// record are read into `beside` on the way and never shown to it.
struct Sifted<'b, A> {
    map: A,
    beside: &'b mut Beside,
}

impl<'de, A: MapAccess<'de>> Sifted<'_, A> {
    /// Reads the value of a field beside the record into `slot`; a field
    /// given twice is an error, as the derive makes it.
    fn take<T: Deserialize<'de>>(
        &mut self,
        name: &'static str,
        slot: impl FnOnce(&mut Beside) -> &mut Option<T>,
    ) -> Result<(), A::Error> {
        let value = self.map.next_value()?;
        let slot = slot(self.beside);
        if slot.is_some() {
            return Err(A::Error::duplicate_field(name));
        }
        *slot = Some(value);
        Ok(())
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Sifted<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        loop {
            let Some(FieldName(name)) = self.map.next_key::<FieldName<'de>>()? else { return Ok(None) };
            match &*name {
                "schema_version" => self.take("schema_version", |b| &mut b.schema_version)?,
                "server" => self.take("server", |b| &mut b.server)?,
                "class" => self.take("class", |b| &mut b.class)?,
                "interface_classes" => self.take("interface_classes", |b| &mut b.interface_classes)?,
                "labels" => self.take("labels", |b| &mut b.labels)?,
                record_field => return seed.deserialize(StrDeserializer::<A::Error>::new(record_field)).map(Some),
            }
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.map.next_value_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        None
    }
}

/// A key of the entry, borrowed from the text where it has no escapes.
struct FieldName<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for FieldName<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl<'de> Visitor<'de> for NameVisitor {
            type Value = FieldName<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }

            fn visit_borrowed_str<E: serde::de::Error>(self, name: &'de str) -> Result<Self::Value, E> {
                Ok(FieldName(Cow::Borrowed(name)))
            }

            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Self::Value, E> {
                Ok(FieldName(Cow::Owned(name.to_owned())))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}
