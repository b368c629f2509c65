//! corrald's socket to the bus, holding every message it sends to the bus's size limit.
//!
//! dbus-daemon drops a connection that sends a message larger than its `max_message_size`
//! (32 MiB on the system bus), and with it corrald's name and every object. Most replies
//! are bounded where they are made (`reply_fits`), but some are written by zbus from the
//! whole object tree: `Introspect` of `/` lists every model's node with zbus's standard
//! interfaces, about 1.4 KB each, and zbus offers no hook to bound it. So the bound is
//! here, under zbus, where every message passes: a reply too large is replaced by the
//! error `org.freedesktop.DBus.Error.LimitsExceeded` to the same call, and anything else
//! too large is not sent and fails its sender. zbus's own transport has no such hook
//! either, so this connects the unix socket itself (the only transport a bus corrald
//! serves on uses).
//!
//! The read half is corrald's too, for one reason: descriptors that come with a message
//! (`CreateWithFiles`' files; any caller may attach some to any call) are taken
//! close-on-exec (`MSG_CMSG_CLOEXEC`), so that no runner or probe spawned while one is held
//! inherits a caller's file. zbus's own read half takes them inheritable.

use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::{SocketAddr, UnixStream};

use zbus::Address;
use zbus::address::transport::{Transport, UnixSocket};
use zbus::connection::socket::{BoxedSplit, ReadHalf, Split, WriteHalf};
use zbus::fdo::ConnectionCredentials;
use zbus::message::{Message, Type};

/// The largest message corrald sends: the system bus's default `max_message_size`.
pub(super) const MAX_MESSAGE: usize = 32 << 20;

/// Connects to the bus at `address` (a unix socket, by path or abstract name), every
/// message sent through the connection held to [`MAX_MESSAGE`].
pub(super) async fn connect(address: &Address) -> zbus::Result<BoxedSplit> {
    let Transport::Unix(unix) = address.transport() else {
        return Err(unsupported(address));
    };
    let socket = match unix.path() {
        UnixSocket::File(path) => SocketAddr::from_pathname(path)?,
        UnixSocket::Abstract(name) => SocketAddr::from_abstract_name(name.as_encoded_bytes())?,
        _ => return Err(unsupported(address)),
    };
    // connect(2) on a unix socket may wait for the listener's backlog: off the runtime.
    let stream = tokio::task::spawn_blocking(move || {
        let stream = UnixStream::connect_addr(&socket)?;
        stream.set_nonblocking(true)?;
        Ok::<_, io::Error>(stream)
    })
    .await
    .map_err(io::Error::other)??;
    let (read, write) = tokio::net::UnixStream::from_std(stream)?.into_split();
    Ok(Split::new(Box::new(CloseOnExec(read)) as Box<dyn ReadHalf>, Box::new(Bounded(write)) as Box<dyn WriteHalf>))
}

fn unsupported(address: &Address) -> zbus::Error {
    zbus::Error::Address(format!(
        "corrald connects to a bus over a unix socket (a path or an abstract name), not {address}"
    ))
}

/// The write half of the bus socket, refusing messages over [`MAX_MESSAGE`].
#[derive(Debug)]
struct Bounded<W>(W);

#[zbus::export::async_trait::async_trait]
impl<W: WriteHalf> WriteHalf for Bounded<W> {
    async fn send_message(&mut self, msg: &Message) -> zbus::Result<()> {
        let bytes = msg.data().len();
        if bytes <= MAX_MESSAGE {
            return self.0.send_message(msg).await;
        }
        if msg.message_type() != Type::MethodReturn {
            return Err(zbus::Error::ExcessData);
        }
        self.0.send_message(&refusal(msg, bytes)?).await
    }

    async fn sendmsg(&mut self, buffer: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
        self.0.sendmsg(buffer, fds).await
    }

    async fn close(&mut self) -> io::Result<()> {
        self.0.close().await
    }

    fn can_pass_unix_fd(&self) -> bool {
        self.0.can_pass_unix_fd()
    }

    async fn peer_credentials(&mut self) -> io::Result<ConnectionCredentials> {
        self.0.peer_credentials().await
    }
}

/// The most descriptors one message brings: the kernel's own limit per message
/// (`SCM_MAX_FD`); the bus passes at most its `max_message_unix_fds` anyway.
const FDS_MAX: usize = 253;

/// The read half of the bus socket, taking the descriptors a message brings close-on-exec.
#[derive(Debug)]
struct CloseOnExec(tokio::net::unix::OwnedReadHalf);

#[zbus::export::async_trait::async_trait]
impl ReadHalf for CloseOnExec {
    async fn recvmsg(&mut self, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
        let stream: &tokio::net::UnixStream = self.0.as_ref();
        loop {
            stream.readable().await?;
            match stream.try_io(tokio::io::Interest::READABLE, || receive(stream.as_fd(), buf)) {
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                received => return received,
            }
        }
    }

    fn can_pass_unix_fd(&self) -> bool {
        true
    }

    async fn peer_credentials(&mut self) -> io::Result<ConnectionCredentials> {
        self.0.peer_credentials().await
    }
}

/// One `recvmsg` of the bus socket: the bytes read and the descriptors that came with them,
/// each close-on-exec from the moment it exists in this process.
fn receive(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(socket, &mut iov, &mut ancillary, RecvFlags::CMSG_CLOEXEC)?;
    if received.bytes == 0 {
        return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the bus closed the connection"));
    }
    let mut fds = Vec::new();
    for message in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(passed) = message {
            fds.extend(passed);
        }
    }
    Ok((received.bytes, fds))
}

/// The error that answers the call `reply` (of `bytes`) answered, in its place.
fn refusal(reply: &Message, bytes: usize) -> zbus::Result<Message> {
    let header = reply.header();
    let mut error = Message::error(&header, "org.freedesktop.DBus.Error.LimitsExceeded")?
        .serial(reply.primary_header().serial_num())
        .reply_serial(header.reply_serial());
    if let Some(destination) = header.destination() {
        error = error.destination(destination.to_owned())?;
    }
    error.build(&(format!(
        "the reply takes {bytes} bytes, more than one message of the bus carries ({MAX_MESSAGE}); \
         ask for less (each object's own Introspect, ListModels, GetAll)"
    ),))
}

#[cfg(test)]
mod tests {
    use zbus::connection::socket::{ReadHalf, Socket, WriteHalf};
    use zbus::message::{Message, Type};

    use super::{Bounded, MAX_MESSAGE, connect};

    /// A call from `:1.7` and the reply to it carrying `text`.
    fn reply_of(text: &str) -> (Message, Message) {
        let call = Message::method_call("/", "Introspect")
            .and_then(|b| b.sender(":1.7"))
            .and_then(|b| b.destination(":1.1"))
            .and_then(|b| b.build(&()))
            .expect("call");
        let reply = Message::method_return(&call.header()).expect("reply").build(&(text,)).expect("reply");
        (call, reply)
    }

    /// What a bus reads from the socket's other end when `message` is sent.
    async fn sent(message: Message) -> Message {
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("pair");
        let mut write = Bounded(ours.split().take().1);
        let mut read = theirs.split().take().0;
        let (mut bytes, mut fds) = (Vec::new(), Vec::new());
        let (sent, read) = tokio::join!(write.send_message(&message), read.receive_message(0, &mut bytes, &mut fds));
        sent.expect("sent");
        read.expect("read")
    }

    #[tokio::test]
    async fn a_reply_too_large_for_the_bus_is_sent_as_limits_exceeded_to_the_same_call() {
        let (call, reply) = reply_of(&"x".repeat(MAX_MESSAGE));
        let read = sent(reply.clone()).await;
        assert_eq!(read.message_type(), Type::Error);
        let header = read.header();
        assert_eq!(
            header.error_name().map(zbus::names::ErrorName::as_str),
            Some("org.freedesktop.DBus.Error.LimitsExceeded")
        );
        assert_eq!(header.reply_serial(), Some(call.primary_header().serial_num()));
        assert_eq!(header.destination().map(zbus::names::BusName::as_str), Some(":1.7"));
        let text: String = read.body().deserialize().expect("text");
        assert!(text.contains(&format!("takes {} bytes", reply.data().len())), "{text}");
    }

    #[tokio::test]
    async fn a_reply_within_the_limit_goes_as_it_is() {
        let (_, reply) = reply_of(&"x".repeat(MAX_MESSAGE - 1024));
        let read = sent(reply.clone()).await;
        assert_eq!(read.message_type(), Type::MethodReturn);
        assert_eq!(read.data().len(), reply.data().len());
        assert_eq!(read.body().deserialize::<String>().expect("text").len(), MAX_MESSAGE - 1024);
    }

    #[tokio::test]
    async fn a_signal_too_large_for_the_bus_is_not_sent_and_fails_its_sender() {
        let signal = Message::signal("/", "org.corral.Corral1.Manager", "Big")
            .and_then(|b| b.build(&("x".repeat(MAX_MESSAGE),)))
            .expect("signal");
        let (ours, _theirs) = tokio::net::UnixStream::pair().expect("pair");
        let mut write = Bounded(ours.split().take().1);
        assert!(matches!(write.send_message(&signal).await, Err(zbus::Error::ExcessData)));
    }

    /// A message's descriptors arrive close-on-exec (a runner spawned meanwhile inherits
    /// none), with the whole message: what zbus's own read half gets inheritable.
    #[tokio::test]
    async fn descriptors_a_message_brings_arrive_close_on_exec() {
        use rustix::io::FdFlags;

        let (call, _) = reply_of("x");
        let file = tempfile::tempfile().expect("a file");
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("pair");
        let (mut read, mut write) = (super::CloseOnExec(ours.into_split().0), theirs.into_split().1);
        let sent = write.sendmsg(call.data(), &[std::os::fd::AsFd::as_fd(&file)]).await.expect("sent");
        assert_eq!(sent, call.data().len());
        let mut buf = vec![0; call.data().len()];
        let (n, fds) = read.recvmsg(&mut buf).await.expect("received");
        assert_eq!((n, fds.len()), (call.data().len(), 1));
        assert_eq!(&buf[..n], &call.data()[..]);
        let flags = rustix::io::fcntl_getfd(&fds[0]).expect("flags");
        assert!(flags.contains(FdFlags::CLOEXEC), "{flags:?}");
        drop(write);
        let closed = read.recvmsg(&mut buf).await.expect_err("the other end closed");
        assert_eq!(closed.kind(), std::io::ErrorKind::BrokenPipe);
    }

    /// The bus is reached at a path or an abstract name; any other transport is refused
    /// with the address named.
    #[tokio::test]
    async fn connects_to_a_unix_socket_by_path_or_abstract_name_and_refuses_other_transports() {
        use std::os::linux::net::SocketAddrExt as _;
        use std::os::unix::net::{SocketAddr, UnixListener};

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bus");
        let by_path = UnixListener::bind(&path).expect("bind");
        let name = format!("corral-test-{}", std::process::id());
        let by_name = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).expect("name")).expect("bind");
        for (address, listener) in
            [(format!("unix:path={}", path.display()), &by_path), (format!("unix:abstract={name}"), &by_name)]
        {
            let address: zbus::Address = address.parse().expect("address");
            connect(&address).await.unwrap_or_else(|e| panic!("{address}: {e}"));
            listener.accept().unwrap_or_else(|e| panic!("{address}: nothing connected: {e}"));
        }
        let tcp: zbus::Address = "tcp:host=127.0.0.1,port=9".parse().expect("address");
        let refused = connect(&tcp).await.expect_err("tcp").to_string();
        assert!(refused.contains("unix socket") && refused.contains("tcp:host=127.0.0.1"), "{refused}");
        drop(std::fs::remove_file(&path));
        let gone = connect(&format!("unix:path={}", path.display()).parse().expect("address")).await;
        assert!(gone.is_err(), "connected to a removed socket");
    }
}
